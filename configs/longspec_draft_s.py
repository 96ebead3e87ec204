"""LongSpec draft for `longspec_target_s`, stage 1: 1,024-token samples with anchor-offset
indices up to 7,168 (covering the target's 8K positions), the paper's 512-position window,
noisy-training shifts 1..5.

    python -m train --config=configs/longspec_draft_s.py --workdir=runs/longspec_draft_s \
        --config.model.family_kwargs.target_workdir=runs/longspec_target_s
"""

from configs.longspec_target_s import get_config as target_config


def get_config():
  c = target_config()
  c.model.family = "longspec_draft"
  c.model.family_kwargs = dict(
    target_workdir="runs/longspec_target_s", window=512, anchor_tokens=4, max_offset=7168, min_shift=1, max_shift=5
  )
  c.data.seq_len = 1024
  c.data.batch_size = 128
  t = c.train
  t.steps = 400
  t.learning_rate = 2e-3
  t.warmup_steps = 30
  t.checkpoint_every = 100
  return c
