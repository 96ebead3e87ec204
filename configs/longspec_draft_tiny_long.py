"""LongSpec draft for `longspec_target_tiny`, stage 2: the target's full 512-token windows
with plain positions (the paper's long-data stage), starting from stage 1's draft:

    python -m train --config=configs/longspec_draft_tiny_long.py --workdir=runs/longspec_draft_tiny_long \
        --config.train.init_from=runs/longspec_draft_tiny
"""

from configs.longspec_draft_tiny import get_config as stage_one_config


def get_config():
  c = stage_one_config()
  c.model.family_kwargs.max_offset = 0
  c.data.seq_len = 512
  c.data.batch_size = 8
  c.train.steps = 100
  c.train.learning_rate = 1e-3
  c.train.warmup_steps = 10
  return c
