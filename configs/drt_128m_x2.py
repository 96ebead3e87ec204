"""DRT-128M with two retrieval groups (the paper's DRT retrieval x2): `drt_128m` with its
6 upper layers split 3 + 3, each group retrieving its own top-8 chunks.

Parameters (castle_jax.models.count_parameters): 146,012,160 (768 more than drt_128m:
the second group's retrieval RMSNorm scale).
"""

from configs.drt_128m import drt_128m_config
from train.config import finalize


def get_config():
  return finalize(drt_128m_config(retrieval_groups=2))
