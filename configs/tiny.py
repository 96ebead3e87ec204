"""A 1.1M-parameter byte-level LM that trains in a few minutes on 2 CPU cores."""

from train.config import base_config, finalize


def get_config():
  c = base_config()
  c.model.d_model = 128
  c.model.n_layers = 4
  c.model.n_heads = 4
  c.model.dtype = "float32"  # CPU has no fast bf16 matmul; use bfloat16 on GPU
  c.data.seq_len = 256
  c.data.batch_size = 16
  c.train.steps = 300
  c.train.learning_rate = 3e-3
  c.train.warmup_steps = 30
  c.train.log_every = 25
  c.train.eval_every = 100
  c.train.eval_batches = 4
  c.train.checkpoint_every = 100
  return finalize(c)
