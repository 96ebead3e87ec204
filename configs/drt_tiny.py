"""A tiny DRT (differentiable retrieval transformer) that trains on 2 CPU cores.

`tiny`'s widths and schedule (d_model 128, 4 heads of 32) with 2 lower and 2 upper
layers, a 1-layer chunk encoder, chunks of 31 tokens + a landmark, k = 4 retrieved chunks
and an ALiBi self-attention window of 64 positions, on 1,023-token windows (33 chunks):
most of the context lies outside the window, so only retrieval reaches it.
"""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  c.model.family = "drt"
  c.model.sliding_window = 64
  c.model.attention_kwargs = dict(positions="alibi")
  # A whole dict: its keys depend on the family, so it is assigned, not extended.
  c.model.family_kwargs = dict(chunk_size=31, top_k=4, retrieval_groups=1, encoder_layers=1)
  c.data.seq_len = 1023
  c.data.batch_size = 4
  c.train.learning_rate = 2e-3
  return c
