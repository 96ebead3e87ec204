"""Variable tracking with overwrites at CPU scale (docs/tasks.md): 8 names, 16
assignments of one-digit values, half of them reassignments, then 4 queries of the
latest value; the loss is on the answers only. The model is `tiny`'s (4 layers, d=128,
full causal attention: model.attention="mha"); `--config.model.attention=castle` (or
another attention) trains the same task with another attention.
"""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  d = c.data
  d.task = "variable_tracking"
  k = d.variable_tracking
  k.names = 8
  k.assignments = 16
  k.overwrite_rate = 0.5
  k.queries = 4
  k.value_vocab = 10
  d.seq_len = 100  # the longest prompt: BOS + 16 * 5 + 4 * 5 bytes
  d.batch_size = 32
  t = c.train
  t.steps = 1500
  t.learning_rate = 3e-3
  t.warmup_steps = 100
  t.log_every = 100
  t.eval_every = 500
  t.eval_batches = 4
  t.checkpoint_every = 500
  return c
