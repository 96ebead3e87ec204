"""Several seeds of one config (`train.seeds`; docs/training.md#several-seeds).

Seed k of a run in WORKDIR is a normal workdir, `WORKDIR/seed_<k>/` (config.json, metrics.jsonl,
checkpoints, lock), trained with `seed = data.shuffle_seed = k`: values of the index alone, never
of the config, so that runs of two configs (the arms of a comparison) with the same seed index
read the same data in the same order and are evaluated on the same batches (a paired design).
`WORKDIR/seeds.json` records the count. `train.seed_indices` trains only some of the N seeds:
processes started with disjoint indices (one per GPU, say) fill one run's workdir together, and
each takes only its own seeds' locks. Every tool that reads a workdir (sampling, the
evaluations, `train.init_from`) reads a seed's as it reads a single run's.

`train.seeds_mode`:
  "vmap" (default): every seed in one process and one compiled step, vmapped over a leading
    seed axis of the train state, the batch ([seeds, B, T], one data iterator per seed) and the
    noise seed; under a device mesh the seed axis is unsharded and every other axis is sharded
    as for one run. Seed k's checkpoints, metrics and evaluations go into its own workdir as a
    single run writes them. The seeds resume together, from the newest checkpoint step that
    every seed has.
  "sequential": the seeds one after another, each with the single-run loop: for models whose
    seeds do not fit on the device together, and for what the vmapped step lacks (a
    family's frozen parameters).

`train.init_from` of a run of several seeds (its seeds.json) starts seed k from the source's
seed k, so a later stage of a recipe (a fine-tune, a control arm) keeps the seeds paired; of a
single run, every seed starts from its parameters.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from castle_jax.checkpoints import Checkpointer, CheckpointError
from castle_jax.data.pipeline import close_iterators, make_lm_iterator
from castle_jax.models import family_of
from castle_jax.sharding import LOGICAL_AXIS_RULES
from castle_jax.workdir import seed_workdir, seeds_record
from train.config import validate_keys
from train.phases import PhaseClock
from train.run_checks import clip_warmup, validate_train_config
from train.run_files import check_layout, claim_for_fresh_run, write_run_files, write_seeds_record
from train.signals import StopSignals
from train.state import TrainState, seed_state_getter, stack_states, state_shardings, with_seed_axis
from train.step import jit_seeds_train_step
from train.trainer import (
  Run,
  RunIO,
  RunOutput,
  StepLogger,
  TrainResult,
  build_run,
  eval_step_fn,
  global_batch,
  note_line,
  open_metrics,
  open_workdir,
  report_line,
  resumed_elapsed,
  restore_or_init,
  run_loop,
  startup_banner,
  step_options,
  train,
)
from train.workdir_lock import acquire_lock


def seed_config(config: ml_collections.ConfigDict, index: int) -> ml_collections.ConfigDict:
  """Seed `index`'s config: one run in its own workdir, with seed = data.shuffle_seed = index,
  and with `train.init_from` a run of several seeds, that run's seed `index`."""
  seeded = copy.deepcopy(config)
  with seeded.unlocked():
    seeded.seed = index
    seeded.data.shuffle_seed = index
    seeded.train.seeds = None
    seeded.train.seed_indices = None
    seeded.workdir = seed_workdir(config.workdir, index)
    if config.train.init_from and seeds_record(config.train.init_from) is not None:
      seeded.train.init_from = seed_workdir(config.train.init_from, index)
  return seeded


def _check_seeds_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError for a setting a run of several seeds cannot combine with."""
  t = config.train
  if not config.workdir:
    raise ValueError("config.workdir is empty: pass --workdir=DIR (seed k goes to DIR/seed_<k>/)")
  if config.seed != 0 or config.data.shuffle_seed != 0:
    raise ValueError(
      f"seed={config.seed} and data.shuffle_seed={config.data.shuffle_seed} cannot be combined with "
      f"train.seeds={t.seeds}: seed k of a run of several uses seed = data.shuffle_seed = k, the same in "
      "every config so that runs with the same seed index are paired; leave both at 0"
    )
  if jax.process_count() > 1:
    raise ValueError(
      f"train.seeds={t.seeds} runs in one process (whose devices may form a mesh), not in "
      f"{jax.process_count()} processes: train each seed (or a few) as its own one-process job with "
      "--config.train.seed_indices=<k>[,<k2>...] and the same --workdir and train.seeds"
    )
  source = seeds_record(t.init_from) if t.init_from else None
  if source is not None and source.get("seeds", 0) < t.seeds:
    raise ValueError(
      f"train.init_from={t.init_from} holds a run of {source.get('seeds')} seeds and seed k starts from its "
      f"seed k: train.seeds={t.seeds} needs as many; train fewer seeds, or init from one run's workdir"
    )


def seed_indices(train_config: ml_collections.ConfigDict) -> list[int]:
  """The seed indices this process trains: `train.seed_indices`, else 0..train.seeds-1."""
  if train_config.get("seed_indices") is not None:
    return list(train_config.seed_indices)
  return list(range(train_config.seeds))


def train_seeds(config: ml_collections.ConfigDict, *, after_step: Callable[[int], None] | None = None):
  """Trains (or resumes) seeds 0..train.seeds-1 of `config` (those of `train.seed_indices`
  only, where set), each in `seed_workdir(workdir, k)`; returns one `TrainResult` per seed
  trained, in the order of the indices. Raises what `train.trainer.train` raises."""
  validate_keys(config)
  validate_train_config(config)
  _check_seeds_config(config)
  config, note = clip_warmup(config)
  indices = seed_indices(config.train)
  # Processes training other indices of this run may hold the workdir at the same time: each
  # process then locks (and applies the resume rules to) its own seeds' workdirs only.
  shared = config.train.get("seed_indices") is not None
  clock = PhaseClock()  # the vmapped run's banner; a sequential seed's train() keeps its own
  with clock.phase("model and mesh"):
    first = build_run(seed_config(config, indices[0]))  # checks every other setting; writes nothing
  if note:
    note_line(note)
  t = config.train
  if t.seeds_mode == "vmap" and family_of(first.model_config).frozen_source is not None:
    raise ValueError(
      f"model.family={first.model_config.family!r} trains against frozen parameters, which the vmapped "
      "step does not take: pass --config.train.seeds_mode=sequential"
    )
  top = os.path.abspath(config.workdir)
  lock = None if shared else acquire_lock(top)  # acquire_lock creates the workdir
  if shared and jax.process_index() == 0:
    os.makedirs(top, exist_ok=True)
  try:
    if t.resume or shared:
      check_layout(top, t.seeds)
    if not shared:
      moved = claim_for_fresh_run(top, resume=t.resume, overwrite=t.overwrite)
      if moved:
        note_line(f"train.overwrite=True: moved the previous run in {top} to {moved}")
    if t.seeds_mode == "sequential":
      write_seeds_record(top, seeds=t.seeds, seeds_mode=t.seeds_mode)
      results = []
      for position, index in enumerate(indices):
        report_line(f"seed {index} ({position + 1} of {len(indices)}): {seed_workdir(top, index)}")
        results.append(train(seed_config(config, index), after_step=after_step))
      return results
    runs = [dataclasses.replace(first, config=seed_config(config, k), workdir=seed_workdir(top, k)) for k in indices]
    return _train_vmapped(runs, top, after_step, t.seeds, clock)
  finally:
    if lock is not None:
      lock.release()


def resume_step_of_seeds(train_config: ml_collections.ConfigDict, checkpointers: list[Checkpointer]) -> int | None:
  """The checkpoint step every seed resumes from: `train.resume_step`, else the newest step
  that every seed has and that passes every seed's checksum (a run killed while saving may
  have saved the last step for some seeds only); None for a fresh start."""
  steps = [set(checkpointer.all_steps()) for checkpointer in checkpointers]
  if not train_config.resume or not any(steps):
    return None
  without = [index for index, found in enumerate(steps) if not found]
  if without:
    raise CheckpointError(
      f"Seeds {without} have no checkpoint while the others have some ({checkpointers[0].directory}: "
      f"{sorted(steps[0] or steps[-1])}); vmapped seeds resume together from one step: finish them with "
      "--config.train.seeds_mode=sequential, or start over in a new --workdir"
    )
  if train_config.resume_step is not None:
    return train_config.resume_step
  for step in sorted(set.intersection(*steps), reverse=True):
    if all(checkpointer.verify(step) is None for checkpointer in checkpointers):
      return step
  raise CheckpointError(
    f"No checkpoint step is held undamaged by every seed (steps per seed: {[sorted(s) for s in steps]}); "
    "resume the seeds one by one with --config.train.seeds_mode=sequential"
  )


def memory_limit_bytes() -> int | None:
  """The first device's memory in bytes, where it reports one (GPUs; None on CPU)."""
  stats = jax.local_devices()[0].memory_stats()
  return (stats or {}).get("bytes_limit")


def check_fits(memory: Any, limit_bytes: int | None, seeds: int) -> None:
  """Raises ValueError when a compiled step's `memory` (`Compiled.memory_analysis()`, per
  device) exceeds `limit_bytes`; nothing when either is unknown."""
  if memory is None or not limit_bytes:
    return
  need = (
    memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes
  )
  if need > limit_bytes:
    raise ValueError(
      f"train.seeds={seeds} vmapped in one step need {need / 2**30:.1f} GiB per device and a device has "
      f"{limit_bytes / 2**30:.1f} GiB: pass --config.train.seeds_mode=sequential (one seed after another), "
      "fewer seeds, or a mesh over more devices"
    )


class _SeedsStep:
  """The vmapped step, compiled at its first call and then checked to fit the device."""

  def __init__(self, jitted, seeds: list[int]):
    self._jitted, self._seeds, self._compiled = jitted, jnp.asarray(seeds, jnp.int32), None

  def __call__(self, state: TrainState, batch: Any):
    if self._compiled is None:
      self._compiled = self._jitted.lower(state, batch, self._seeds).compile()
      check_fits(self._compiled.memory_analysis(), memory_limit_bytes(), int(self._seeds.size))
    return self._compiled(state, batch, self._seeds)


def _stacked(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
  return {key: np.stack([batch[key] for batch in batches]) for key in batches[0]}


def _train_vmapped(
  runs: list[Run], top: str, after_step: Callable[[int], None] | None, seeds: int, clock: PhaseClock
) -> list[TrainResult]:
  """Trains `runs` (seeds of the run of `seeds` seeds in `top`) vmapped in one step; `clock`
  has timed the start-up so far, for the banner."""
  first, count = runs[0], len(runs)
  t = first.config.train
  locks, checkpointers, iterators, writers = [], [], [], []
  try:
    for run in runs:
      lock, checkpointer = open_workdir(run)
      locks.append(lock)
      checkpointers.append(checkpointer)
    with contextlib.ExitStack() as stack:
      stop = stack.enter_context(StopSignals())
      stack.enter_context(jax.set_mesh(first.mesh))
      stack.enter_context(nn.logical_axis_rules(LOGICAL_AXIS_RULES))
      abstract_state, shardings = state_shardings(first.model, first.tx, first.mesh, first.config.data.seq_len)
      with clock.phase("data"):
        for run in runs:
          d = run.config.data
          iterators.append(make_lm_iterator(d, run.tokenizer, split=d.train_split, shuffle=True, prefetch=d.prefetch))
      step = resume_step_of_seeds(t, checkpointers)
      states, init_sources = [], []
      with clock.phase("parameters"):
        for run, checkpointer, iterator in zip(runs, checkpointers, iterators):
          state, resumed_step, init_source = restore_or_init(
            run, checkpointer, abstract_state, shardings, iterator, step=step
          )
          states.append(state)
          init_sources.append(init_source)
        jax.block_until_ready(states)
      for run in runs:
        write_run_files(run.workdir, run.config)
      write_seeds_record(top, seeds=seeds, seeds_mode="vmap")
      writers.extend(open_metrics(run.workdir, resumed_step) for run in runs)
      for writer, init_source in zip(writers, init_sources):
        if init_source is not None:  # as a single run records it: the step its parameters came from
          writer.write(0, "init_from", {"source_step": init_source.step})
      if resumed_step is not None:
        start = f"resumed from step {resumed_step} ({os.path.join(top, 'seed_*', 'checkpoints', str(resumed_step))})"
      elif init_sources[0] is not None:
        start = (
          "; ".join(
            f"seed {run.config.seed}: parameters of {source.describe()}" for run, source in zip(runs, init_sources)
          )
          + " (train.init_from)"
        )
      else:
        start = "fresh (random parameters)"
      which = "" if count == seeds else f" of {seeds} (indices {[run.config.seed for run in runs]})"
      seeds_line = (
        f"{count}{which}, vmapped in one step; seed k in {seed_workdir(top, '<k>')} (seed = data.shuffle_seed = k)"
      )
      report_line(
        startup_banner(
          dataclasses.replace(first, workdir=top), abstract_state, start, None, seeds_line, ready=clock.describe()
        )
      )
      state = stack_states(states, shardings)
      del states
      outputs = [
        RunOutput(writer, checkpointer, resumed_elapsed(run.workdir, resumed_step), f"Seed {k} ({run.workdir}): ")
        for k, (run, writer, checkpointer) in enumerate(zip(runs, writers, checkpointers))
      ]
      logger = StepLogger(first, outputs, int(np.reshape(jax.device_get(state.step), -1)[0]), resumed_step)
      batch_sharding = with_seed_axis(first.batch_sharding)
      jitted = jit_seeds_train_step(
        **step_options(first), state_shardings=shardings, batch_sharding=first.batch_sharding
      )
      seed_state = seed_state_getter(shardings)
      io = RunIO(
        configs=[run.config for run in runs],
        tokenizer=first.tokenizer,
        train_iters=iterators,
        checkpointers=checkpointers,
        put_batch=lambda batches: global_batch(_stacked(batches), batch_sharding),
        state_of=seed_state,
        step_fn=_SeedsStep(jitted, [run.config.seed for run in runs]),
        eval_fn=jax.jit(jax.vmap(eval_step_fn(first))),
        logger=logger,
        checkpoint_name=lambda step: os.path.join(top, "seed_*", "checkpoints", str(step)),
      )
      try:
        state, last_train, last_eval = run_loop(first, state, io, stop, after_step)
      except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        raise ValueError(
          f"train.seeds={count} vmapped in one step ran out of device memory: pass "
          "--config.train.seeds_mode=sequential (one seed after another), fewer seeds, or a mesh over more devices"
        ) from e
  finally:
    try:
      close_iterators(iterators)
      for resource in (*checkpointers, *writers):
        resource.close()
    finally:
      for lock in locks:
        if lock is not None:
          lock.release()
  final_step = int(np.reshape(jax.device_get(state.step), -1)[0])
  report_line(
    f"Finished step {final_step} of {t.steps}; saved checkpoints "
    f"{os.path.join(top, 'seed_*', 'checkpoints', str(final_step))} ({count} seeds)"
  )
  return [
    TrainResult(seed_state(state, k), last_train[k] if last_train else {}, last_eval[k] if last_eval else {})
    for k in range(count)
  ]
