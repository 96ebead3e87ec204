"""In-context-learning curve experiment on one GPU: gated power attention (p = 2) at
8192-token context, on the Triton kernels.

See train.presets.icl_gpu_config; run all three arms with several seeds and their curves with
benchmarks/power_icl_seeds.sh (docs/evaluation.md#in-context-learning-curve).
"""

from train.config import finalize
from train.presets import icl_gpu_config


def get_config():
  return finalize(icl_gpu_config("power"))
