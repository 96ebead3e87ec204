"""The sliding-window ALiBi baseline of `drt_128m` (the paper's 12-layer "Base LM" with a
512-token window): the same widths, depth, window, data and optimizer, no chunk encoder
and no retrieval; what lies more than 512 positions back it cannot see.

Parameters (castle_jax.models.count_parameters, tied embeddings): 123,587,328.
"""

from configs.drt_128m import paper_128m_config
from train.config import finalize


def get_config():
  return finalize(paper_128m_config())
