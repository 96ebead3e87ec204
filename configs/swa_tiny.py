"""The sliding-window ALiBi baseline of `drt_tiny`: the same widths, depth, window and
data (4 layers of `mha` with ALiBi over 64 positions, 1,023-token windows), no retrieval.
What it cannot see lies more than 64 positions back; DRT reaches it only by retrieval."""

from configs.tiny import get_config as tiny_config


def get_config():
  c = tiny_config()
  c.model.sliding_window = 64
  c.model.attention_kwargs = dict(positions="alibi")
  c.data.seq_len = 1023
  c.data.batch_size = 4
  c.train.learning_rate = 2e-3
  return c
