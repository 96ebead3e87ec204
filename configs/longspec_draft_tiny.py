"""LongSpec draft for `longspec_target_tiny`, stage 1: short samples with anchor-offset
indices (the paper's first stage, Sec. 3.2).

model.* are the target's widths (checked against its workdir); the family options:
a 64-position self-attention window (the paper: 512, here 1/8 of the target's context
so that the ring buffer is exercised), anchor-offset positions [0..3, 4 + o, ...] with
o <= 384 on 128-token samples (covering the target's 512 positions), noisy training
shifts 1..5 (a 5-level tree drafts at depths 0..4). The target stays frozen; only the
draft block trains.

    python -m train --config=configs/longspec_draft_tiny.py --workdir=runs/longspec_draft_tiny \
        --config.model.family_kwargs.target_workdir=runs/longspec_target_tiny
"""

from configs.longspec_target_tiny import get_config as target_config


def get_config():
  c = target_config()
  c.model.family = "longspec_draft"
  c.model.family_kwargs = dict(
    target_workdir="runs/longspec_target_tiny", window=64, anchor_tokens=4, max_offset=384, min_shift=1, max_shift=5
  )
  c.data.seq_len = 128
  c.data.batch_size = 16
  c.train.learning_rate = 3e-3
  return c
