"""The tiny byte-level LM with CASTLE-SWL attention: `tiny_castle` with lookahead
keys that see the next 64 tokens (a quarter of the context, the paper's M/L/XL ratio)."""

from configs.tiny_castle import get_config as tiny_castle_config


def get_config():
  c = tiny_castle_config()
  c.model.attention = "castle_swl"
  # A whole dict: its keys depend on the attention, so it is assigned, not extended.
  c.model.attention_kwargs = dict(lookahead_window=64)
  return c
