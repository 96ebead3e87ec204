"""AdamW with warm-up + cosine decay and global-norm clipping (the CASTLE paper's recipe)."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(train_config) -> optax.Schedule:
  """Linear warm-up from 0 to the peak, then cosine down to min_lr_ratio x peak at the last step."""
  t = train_config
  if t.warmup_steps < 0 or t.warmup_steps > t.steps:
    raise ValueError(f"train.warmup_steps must be in [0, train.steps={t.steps}], got {t.warmup_steps}")
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=t.learning_rate,
    warmup_steps=t.warmup_steps,
    decay_steps=max(t.steps, t.warmup_steps + 1),
    end_value=t.learning_rate * t.min_lr_ratio,
  )


def _decay_mask(params):
  # Matrices decay; norm scales (vectors) do not.
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(train_config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  t = train_config
  schedule = learning_rate_schedule(t)
  tx = optax.chain(
    optax.clip_by_global_norm(t.grad_clip),
    optax.adamw(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay, mask=_decay_mask),
  )
  return tx, schedule
