"""The tiny byte-level LM with gated power attention (p = 2).

Same widths as `tiny` (4 heads of 32); power attention adds only the gate projection
(128 x 4 weights per layer). Each head keeps a state of D = C(32 + 1, 2) = 528
expanded keys by 32 values; with 64-token chunks the 256-token context runs 4 chunks,
so training exercises the state path, not only the in-chunk attention.
"""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  c.model.attention = "power"
  # A whole dict: its keys depend on the attention, so it is assigned, not extended.
  c.model.attention_kwargs = dict(p=2, chunk_size=64)
  return c
