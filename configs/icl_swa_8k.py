"""In-context-learning curve experiment on one GPU: sliding-window softmax attention at
8192-token context, window 272 (a KV cache as large as the power-attention state; cuDNN
flash attention).

See train.presets.icl_gpu_config; run all three arms with several seeds and their curves with
benchmarks/power_icl_seeds.sh (docs/evaluation.md#in-context-learning-curve).
"""

from train.config import finalize
from train.presets import icl_gpu_config


def get_config():
  return finalize(icl_gpu_config("swa"))
