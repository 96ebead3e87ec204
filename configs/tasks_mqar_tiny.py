"""Multi-query associative recall at CPU scale (docs/tasks.md): 16 key-value pairs
(one-letter keys, one-digit values), then 4 of the keys again, each to be followed by its
value; the loss is on the answers only. The model is `tiny`'s (4 layers, d=128, full
causal attention: model.attention="mha"); `--config.model.attention=castle` (or another
attention) trains the same task with another attention.
"""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  d = c.data
  d.task = "mqar"
  k = d.mqar
  k.pairs = 16
  k.queries = 4
  k.value_vocab = 10
  d.seq_len = 80  # the longest prompt: BOS + 20 * 4 bytes
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
