"""In-context-learning curve experiment (CPU scale): sliding-window softmax attention at
4096-token context, window 272 (a KV cache as large as the power-attention state).

See train.presets.icl_config; compare with the other icl_* configs via
benchmarks/icl_curve.py (loss vs position in context).
"""

from train.config import finalize
from train.presets import icl_config


def get_config():
  return finalize(icl_config("swa"))
