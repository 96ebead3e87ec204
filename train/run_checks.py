"""Checks of the `train` and `data` settings that fail before anything runs,
each with an error naming the key and what it must be."""

from __future__ import annotations

import copy
import math
from typing import Any

# How the seeds of a run of several (`train.seeds`) run: train/seeds.py.
SEEDS_MODES = ("vmap", "sequential")


def _require(ok: bool, key: str, rule: str, value: Any) -> None:
  if not ok:
    raise ValueError(f"{key} must be {rule}, got {value!r}")


def validate_train_config(config) -> None:
  """Raises ValueError naming the first `train.*`/`data.*` value that makes no sense."""
  t, d = config.train, config.data
  _require(isinstance(t.steps, int) and t.steps >= 1, "train.steps", "an integer >= 1", t.steps)
  _require(
    isinstance(t.warmup_steps, int) and t.warmup_steps >= 0, "train.warmup_steps", "an integer >= 0", t.warmup_steps
  )
  _require(t.log_every >= 1, "train.log_every", ">= 1", t.log_every)
  _require(t.eval_every >= 0, "train.eval_every", ">= 0 (0: only at the last step)", t.eval_every)
  _require(t.checkpoint_every >= 0, "train.checkpoint_every", ">= 0 (0: only at the last step)", t.checkpoint_every)
  _require(t.eval_batches >= 0, "train.eval_batches", ">= 0 (0: no evaluation)", t.eval_batches)
  _require(t.keep_checkpoints >= 1, "train.keep_checkpoints", ">= 1", t.keep_checkpoints)
  finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)
  _require(
    finite(t.learning_rate) and t.learning_rate > 0, "train.learning_rate", "a finite number > 0", t.learning_rate
  )
  _require(finite(t.min_lr_ratio) and 0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", "in [0, 1]", t.min_lr_ratio)
  _require(finite(t.b1) and 0 <= t.b1 < 1, "train.b1", "in [0, 1)", t.b1)
  _require(finite(t.b2) and 0 <= t.b2 < 1, "train.b2", "in [0, 1)", t.b2)
  _require(finite(t.eps) and t.eps > 0, "train.eps", "a finite number > 0", t.eps)
  _require(finite(t.weight_decay) and t.weight_decay >= 0, "train.weight_decay", "a finite number >= 0", t.weight_decay)
  _require(finite(t.grad_clip) and t.grad_clip > 0, "train.grad_clip", "a finite number > 0", t.grad_clip)
  _require(t.resume_step is None or t.resume_step >= 0, "train.resume_step", ">= 0 or None", t.resume_step)
  _require(t.resume_step is None or t.resume, "train.resume_step", "unset when train.resume=False", t.resume_step)
  _require(
    not (t.overwrite and t.resume), "train.overwrite", "used with train.resume=False (it starts over)", t.overwrite
  )
  seeds = t.get("seeds")
  _require(
    seeds is None or (isinstance(seeds, int) and seeds >= 1),
    "train.seeds",
    "an integer >= 1 (or None: one run in the workdir)",
    seeds,
  )
  _require(t.get("seeds_mode", "vmap") in SEEDS_MODES, "train.seeds_mode", f"one of {SEEDS_MODES}", t.get("seeds_mode"))
  indices = t.get("seed_indices")
  if indices is not None:
    _check_seed_indices(indices, seeds, t.overwrite)
  _require(d.prefetch >= 0, "data.prefetch", ">= 0 (0: no background reading)", d.prefetch)
  _require(d.worker_count >= 0, "data.worker_count", ">= 0", d.worker_count)


def _check_seed_indices(indices: Any, seeds: int | None, overwrite: bool) -> None:
  """Raises ValueError naming train.seed_indices unless it is a non-empty tuple of distinct
  integers in [0, train.seeds) and the run may share its workdir with other processes."""
  if seeds is None:
    raise ValueError(
      f"train.seed_indices={indices} needs train.seeds=N, the run's seed count (seed indices are 0..N-1): "
      f"pass --config.train.seeds=N as well"
    )
  where = f"train.seed_indices must be a non-empty tuple of distinct integers in [0, train.seeds={seeds})"
  if not isinstance(indices, (tuple, list)) or not indices:
    raise ValueError(f"{where}, got {indices!r}")
  bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < seeds]
  if bad:
    raise ValueError(f"{where}, got {tuple(indices)!r} ({', '.join(repr(i) for i in bad)} not)")
  repeated = sorted({i for i in indices if list(indices).count(i) > 1})
  if repeated:
    raise ValueError(f"{where}, got {tuple(indices)!r} ({repeated[0]} twice)")
  if overwrite:
    # Other processes may be training the other indices in the same workdir.
    raise ValueError(
      f"train.overwrite=True moves the whole run of {seeds} seeds aside, which train.seed_indices={tuple(indices)} "
      "shares with the processes training its other seeds: start over in a new --workdir instead"
    )


def clip_warmup(config) -> tuple[Any, str | None]:
  """(config, note): a warm-up longer than the run (a short smoke run of a config made for a
  long one) is clipped to train.steps, in a copy of the config, with a note saying so."""
  t = config.train
  if t.warmup_steps <= t.steps:
    return config, None
  clipped = copy.deepcopy(config)
  with clipped.unlocked():
    clipped.train.warmup_steps = t.steps
  return clipped, (
    f"NOTE: train.warmup_steps={t.warmup_steps} is more than train.steps={t.steps}: the warm-up is clipped to "
    f"{t.steps} steps (set --config.train.warmup_steps to choose it)"
  )
