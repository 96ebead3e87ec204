"""A one-GPU LongSpec target: a 16-layer Llama-style byte-level LM with an 8K context.

d_model 512, 16 layers, 8 query heads over 4 key/value heads of 64 (grouped-query, as a
LongSpec draft mirrors), RoPE, full causal attention (cuDNN), bf16; 8,192-token windows of
the embedded corpus, 32 windows (262K tokens) per step. On one H100 it is trained for a
time budget by benchmarks/longspec.sh (then `longspec_draft_s` and `longspec_draft_s_long`).
"""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  m = c.model
  m.d_model, m.n_layers, m.n_heads, m.n_kv_heads = 512, 16, 8, 4
  m.dtype = "bfloat16"
  c.data.seq_len = 8192
  c.data.batch_size = 32
  t = c.train
  t.steps = 300
  t.learning_rate = 1.5e-3
  t.warmup_steps = 30
  t.log_every = 50
  t.eval_every = 0
  t.eval_batches = 2
  t.checkpoint_every = 100
  return c
