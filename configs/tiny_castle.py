"""The tiny byte-level LM with CASTLE attention.

Parameter parity as in the paper: head_dim stays 32 and the head count drops from
4 to 2 (about 4/7 of the baseline's), so the attention has 7 * 2 * 32 * 128 weights
against the baseline's 4 * 4 * 32 * 128.
"""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  c.model.attention = "castle"
  c.model.n_heads = 2
  c.model.head_dim = 32
  return c
