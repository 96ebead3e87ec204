"""LongSpec draft for `longspec_target_s`, stage 2: the target's 8K windows with plain
positions, starting from stage 1's draft (`--config.train.init_from=runs/longspec_draft_s`)."""

from configs.longspec_draft_s import get_config as stage_one_config


def get_config():
  c = stage_one_config()
  c.model.family_kwargs.max_offset = 0
  c.data.seq_len = 8192
  c.data.batch_size = 16
  t = c.train
  t.steps = 250
  t.learning_rate = 5e-4
  t.warmup_steps = 10
  return c
