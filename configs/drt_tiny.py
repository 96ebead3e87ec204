"""A tiny DRT (differentiable retrieval transformer) that trains on 2 CPU cores.

Same widths as `tiny` (d_model 128, 4 heads of 32) with 2 lower and 2 upper layers,
a 1-layer chunk encoder, chunks of 31 tokens + a landmark, k = 4 retrieved chunks and an
ALiBi self-attention window of 64 positions, on 1,024-token windows (33 chunks): most of
the context lies outside the window, so only retrieval reaches it.
"""

from train.config import base_config, finalize


def get_config():
  c = base_config()
  c.model.family = "drt"
  c.model.d_model = 128
  c.model.n_layers = 4
  c.model.n_heads = 4
  c.model.sliding_window = 64
  c.model.dtype = "float32"  # CPU has no fast bf16 matmul; use bfloat16 on GPU
  # A whole dict: its keys depend on the family, so it is assigned, not extended.
  c.model.family_kwargs = dict(chunk_size=31, top_k=4, retrieval_groups=1, encoder_layers=1)
  c.data.seq_len = 1023
  c.data.batch_size = 4
  c.train.steps = 300
  c.train.learning_rate = 2e-3
  c.train.warmup_steps = 30
  c.train.log_every = 25
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.train.checkpoint_every = 100
  return finalize(c)
