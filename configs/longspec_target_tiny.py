"""A tiny Llama-style target for LongSpec speculative decoding that trains on 2 CPU cores.

`tiny`'s widths with grouped-query attention (4 query heads over 2 key/value heads, as
the draft must mirror) on 512-token windows. Train it first; the draft configs
(`longspec_draft_tiny`, then `longspec_draft_tiny_long`) read it from runs/longspec_target_tiny.
"""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  c.model.n_kv_heads = 2
  c.data.seq_len = 512
  c.data.batch_size = 8
  return c
