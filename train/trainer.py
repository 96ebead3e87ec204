"""The training loop: sharded state, jitted step, eval, metrics, Orbax checkpoints.

`train(config)` is four pieces, each with one job:
  `build_run`        validate the config and build model, tokenizer, mesh, optimizer
                     (touches no file);
  `open_workdir`     lock the workdir and apply the resume/overwrite rules;
  `restore_or_init`  the train state and data position (newest good checkpoint, or
                     fresh: random, another run's or a Hugging Face model's parameters,
                     `train.init_from`),
                     after which config.json is written;
  `run_loop`         the steps, with `StepLogger` (metrics, console) and the
                     `ThroughputWindow` (tokens/s, MFU, input wait).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tqdm

from castle_jax.checkpoints import Checkpointer, CheckpointError
from castle_jax.data.pipeline import make_lm_iterator
from castle_jax.data.tokenizer import Tokenizer, load_tokenizer
from castle_jax.eval.perplexity import summarize
from castle_jax.models import ModelConfig, build_model, training_flops_per_token
from castle_jax.models.hf import is_hf_model_dir
from castle_jax.sharding import LOGICAL_AXIS_RULES
from castle_jax.workdir import (
  FrozenParams,
  frozen_record,
  restore_source_params,
  saved_config,
  with_hf_frozen_source,
)
from castle_jax.workdir import load_frozen_params as load_frozen
from train.config import validate_keys
from train.mesh import data_parallel_size, make_mesh
from train.metrics import (
  METRICS_NAME,
  SET_ASIDE_NAME,
  MetricsWriter,
  ThroughputWindow,
  format_eval_line,
  format_seeds_eval_line,
  format_seeds_train_line,
  format_train_line,
  read_metrics,
)
from train.optimizer import make_optimizer
from train.phases import PhaseClock
from train.resume_checks import (
  ConfigMismatchError,
  check_init_from,
  check_model_unchanged,
  check_same_tokenizer,
  check_data_workers_unchanged,
  check_schedule_unchanged,
  check_tokenizer_unchanged,
)
from train.run_checks import clip_warmup, validate_train_config
from train.run_files import check_layout, claim_for_fresh_run, write_frozen_record, write_run_files
from train.signals import StopSignals, StopVote, TrainingInterrupted
from train.state import TrainState, init_train_state, state_shardings
from train.step import eval_step, jit_train_step, with_frozen
from train.throughput import peak_flops_per_device
from train.workdir_lock import WorkdirBusyError, WorkdirLock, acquire_lock

# A divergence this many steps after a resume points at the restored checkpoint.
RECENT_RESUME_STEPS = 20


class TrainingDivergedError(FloatingPointError):
  """The loss or gradient norm became NaN/inf; the last good checkpoint is kept."""


# What `train` raises with a message that says what to change: commands print it as one line.
ERRORS_WITH_A_FIX = (
  ValueError,  # ConfigMismatchError and WorkdirNotEmptyError too
  FileNotFoundError,
  CheckpointError,
  WorkdirBusyError,
  TrainingDivergedError,
)


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  last_train_metrics: dict[str, float]
  last_eval_metrics: dict[str, float]


@dataclasses.dataclass
class Run:
  """Everything built from the config before any file is touched."""

  config: ml_collections.ConfigDict
  workdir: str
  model_config: ModelConfig
  model: nn.Module
  tokenizer: Tokenizer
  mesh: jax.sharding.Mesh
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  batch_sharding: jax.sharding.NamedSharding
  flops_per_token: float


def _validate_batching(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
  d, t = config.data, config.train
  if d.seq_len < 1:
    raise ValueError(f"data.seq_len must be >= 1, got {d.seq_len}")
  if t.grad_accum_steps < 1:
    raise ValueError(f"train.grad_accum_steps must be >= 1, got {t.grad_accum_steps}")
  shards = data_parallel_size(mesh)
  if d.batch_size < 1 or d.batch_size % (shards * t.grad_accum_steps):
    raise ValueError(
      f"data.batch_size ({d.batch_size}) must be a positive multiple of mesh data x fsdp ({shards}) "
      f"x train.grad_accum_steps ({t.grad_accum_steps}) so every device gets whole sequences "
      "in every microbatch"
    )
  if d.batch_size % jax.process_count():
    raise ValueError(f"data.batch_size ({d.batch_size}) must be divisible by the {jax.process_count()} processes")


def build_run(config: ml_collections.ConfigDict) -> Run:
  """Validates `config` and builds what the run needs; writes nothing."""
  validate_keys(config)
  if not config.workdir:
    raise ValueError("config.workdir is empty: pass --workdir=DIR (checkpoints and metrics go there)")
  validate_train_config(config)
  config, note = clip_warmup(config)
  if note:
    note_line(note)
  config, note = with_hf_frozen_source(config)
  if note:
    note_line(note)
  model_config = ModelConfig.from_mapping(config.model)
  if config.train.init_from and is_hf_model_dir(config.train.init_from):
    # Before the tokenizer loads, whose own errors (a vocabulary the model cannot hold) would point
    # elsewhere; the same model and tokenizer hold when this run resumes from its own checkpoints.
    check_init_from(config.train.init_from, config.model, config.data.tokenizer)
  tokenizer = load_tokenizer(config.data.tokenizer)
  if model_config.vocab_size < tokenizer.vocab_size:
    raise ValueError(
      f"model.vocab_size ({model_config.vocab_size}) is smaller than the tokenizer's vocabulary "
      f"({tokenizer.vocab_size}); raise model.vocab_size"
    )
  mesh = make_mesh(config.mesh)
  _validate_batching(config, mesh)
  model = build_model(model_config)
  tx, schedule = make_optimizer(config.train)
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
  return Run(
    config=config,
    workdir=os.path.abspath(config.workdir),
    model_config=model_config,
    model=model,
    tokenizer=tokenizer,
    mesh=mesh,
    tx=tx,
    schedule=schedule,
    batch_sharding=batch_sharding,
    flops_per_token=training_flops_per_token(model_config, config.data.seq_len),
  )


def open_workdir(run: Run) -> tuple[WorkdirLock | None, Checkpointer]:
  """Takes the workdir lock (process 0) and applies the resume/overwrite rules;
  when resuming, checks the model and schedule against the saved config.json
  before Orbax reads anything, and for a fresh run with `train.init_from` the model
  and tokenizer against that run's. Returns (lock, checkpointer)."""
  t = run.config.train
  lock = acquire_lock(run.workdir)
  checkpointer = None
  try:
    if t.resume:
      check_layout(run.workdir, None)
    moved = claim_for_fresh_run(run.workdir, resume=t.resume, overwrite=t.overwrite)
    if moved:
      note_line(f"train.overwrite=True: moved the previous run in {run.workdir} to {moved}")
    checkpointer = Checkpointer(os.path.join(run.workdir, "checkpoints"), keep=t.keep_checkpoints)
    if t.resume and checkpointer.all_steps():
      check_model_unchanged(run.workdir, run.config.model)
      check_tokenizer_unchanged(run.workdir, run.config.data.tokenizer)
      saved = saved_config(run.workdir)
      check_data_workers_unchanged(saved, run.config, run.workdir)
      changed = check_schedule_unchanged(saved, run.config, run.workdir)
      if changed:
        note_line(
          f"WARNING: {'!' * 60}\nWARNING: the learning-rate schedule changes at the resumed step "
          f"({'; '.join(changed)}; train.allow_schedule_change=True)\nWARNING: {'!' * 60}"
        )
    elif t.resume_step is not None:
      raise ValueError(f"train.resume_step={t.resume_step} but there are no checkpoints in {checkpointer.directory}")
    elif t.init_from:
      check_init_from(t.init_from, run.config.model, run.config.data.tokenizer)
  except BaseException:
    try:
      if checkpointer is not None:
        checkpointer.close()
    finally:
      if lock is not None:
        lock.release()
    raise
  return lock, checkpointer


@dataclasses.dataclass(frozen=True)
class InitSource:
  """Where a fresh run's parameters came from (`train.init_from`): a training workdir's
  checkpoint, or a Hugging Face model directory's weights (`hugging_face`, step `HF_STEP`)."""

  workdir: str
  step: int
  hugging_face: bool = False

  def describe(self) -> str:
    """'the Hugging Face weights in DIR' or 'step N of DIR', for messages."""
    if self.hugging_face:
      return f"the Hugging Face weights in {self.workdir}"
    return f"step {self.step} of {self.workdir}"


def restore_or_init(
  run: Run,
  checkpointer: Checkpointer,
  abstract_state: TrainState,
  shardings: TrainState,
  train_iter,
  *,
  step: int | None = None,
) -> tuple[TrainState, int | None, InitSource | None]:
  """(state, the checkpoint step resumed from or None, the run the parameters were
  initialised from or None); restores `train_iter` in place.

  The run's own checkpoints win (`step`, else `train.resume_step`, else the newest good
  one); else `train.init_from` gives the parameters (its newest good checkpoint, or a Hugging
  Face model directory's weights) with a fresh optimizer state and step 0; else random."""
  t = run.config.train
  if t.resume and checkpointer.all_steps():
    step = t.resume_step if step is None else step
    state, step, _ = checkpointer.restore_good(abstract_state, train_iter, step=step, log=note_line)
    note_line(
      f"Resumed from step {step} in {checkpointer.directory}"
      + (f"; train.init_from={t.init_from} is ignored (this run's own checkpoints win)" if t.init_from else "")
    )
    return state, step, None
  if t.init_from:
    source = os.path.abspath(t.init_from)
    params, step = restore_source_params(
      source, run.model_config, abstract_state.params, log=note_line, what="train.init_from"
    )
    init_source = InitSource(source, step, hugging_face=is_hf_model_dir(source))
    start = jax.jit(
      lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=run.tx.init(p)),
      out_shardings=shardings,
      donate_argnums=0,
    )
    note_line(
      f"Initialised the parameters from {init_source.describe()} (train.init_from); the optimizer state "
      "and the step start fresh"
    )
    return start(params), None, init_source
  return (
    init_train_state(run.model, run.tx, jax.random.key(run.config.seed), run.config.data.seq_len, shardings),
    None,
    None,
  )


def load_frozen_params(run: Run) -> FrozenParams | None:
  """The family's frozen parameters (a LongSpec draft's target) restored into the mesh,
  after checking that their run used this run's tokenizer; None for other families."""
  frozen = load_frozen(run.model_config, run.mesh, log=note_line)
  if frozen is None:
    return None
  check_same_tokenizer(frozen.workdir, run.config.data.tokenizer, what=f"the frozen parameters' run {frozen.workdir}")
  note_line(
    f"Frozen parameters {sorted(frozen.params)} from step {frozen.step} of {frozen.workdir} "
    f"(fingerprint {frozen.fingerprint})"
  )
  return frozen


def note_line(text: str) -> None:
  """A note or warning (stderr), from process 0."""
  if jax.process_index() == 0:
    print(text, file=sys.stderr, flush=True)


def report_line(text: str) -> None:
  """A line of the run's report (stdout, with the progress lines), from process 0."""
  if jax.process_index() == 0:
    print(text, flush=True)


def describe_start(
  checkpointer: Checkpointer, resumed_step: int | None, init_source: InitSource | None, seed: int
) -> str:
  """Where a run's parameters come from, for the banner."""
  if resumed_step is not None:
    return f"resumed from step {resumed_step} ({checkpointer.step_dir(resumed_step)})"
  if init_source is not None:
    return f"parameters of {init_source.describe()} (train.init_from)"
  return f"fresh (random parameters, seed {seed})"


def startup_banner(
  run: Run,
  abstract_state: TrainState,
  start: str,
  frozen: FrozenParams | None,
  seeds: str | None = None,
  ready: str | None = None,
) -> str:
  """What is about to run: model and parameters, devices and mesh, workdir, where the
  parameters come from (`start`, e.g. `describe_start`), the schedule, `seeds` (a run of
  several seeds: how they run, where each one's workdir is) and `ready` (where the start-up's
  time went: `PhaseClock.describe`)."""
  m, t, d = run.model_config, run.config.train, run.config.data
  parameters = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_state.params))
  mesh = " x ".join(f"{axis} {size}" for axis, size in run.mesh.shape.items())
  lines = [
    f"model     {m.family} ({m.attention} attention), {parameters / 1e6:.2f}M trained parameters, "
    f"{m.n_layers} layers x {m.d_model}, {m.dtype}"
    + (f"; frozen {sorted(frozen.params)} from {frozen.workdir}" if frozen is not None else ""),
    f"devices   {jax.device_count()} x {jax.devices()[0].device_kind} in {jax.process_count()} process(es); "
    f"mesh {mesh}",
    f"workdir   {run.workdir}",
    f"start     {start}",
    f"schedule  {t.steps} steps of {d.batch_size} x {d.seq_len} tokens, learning rate {t.learning_rate:g} "
    f"(warm-up {t.warmup_steps}), log every {t.log_every}, checkpoint every {t.checkpoint_every or t.steps}",
  ]
  if seeds is not None:
    lines.append(f"seeds     {seeds}")
  if ready is not None:
    lines.append(f"ready     {ready}")
  return "\n".join(lines)


def global_batch(local_batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding):
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def _check_finite(
  step: int, metrics: dict[str, float], checkpointer: Checkpointer, resumed_step: int | None, label: str = ""
) -> None:
  bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
  if not bad:
    return
  checkpointer.wait()
  latest = checkpointer.latest_step()
  message = f"{label}Training diverged at step {step}: {bad}. No checkpoint was written from this point on; " + (
    f"the last good checkpoint is step {latest} in {checkpointer.directory}."
    if latest is not None
    else f"no checkpoint had been written yet in {checkpointer.directory}."
  )
  suspect = resumed_step is not None and step - resumed_step <= RECENT_RESUME_STEPS
  if suspect:
    older = [s for s in checkpointer.all_steps() if s < resumed_step]
    message += (
      f" This run resumed from checkpoint step {resumed_step} "
      f"({checkpointer.step_dir(resumed_step)}) only {step - resumed_step} step(s) earlier: suspect "
      "that checkpoint first"
      + (f" and resume from an older one with --config.train.resume_step=N (available: {older})." if older else ".")
    )
  message += (
    " Otherwise l" if suspect else " L"
  ) + "ower train.learning_rate, raise train.warmup_steps or check the data, then resume."
  raise TrainingDivergedError(message)


def evaluate(
  params,
  eval_fn: Callable,
  configs: list[ml_collections.ConfigDict],
  tokenizer: Tokenizer,
  put_batch: Callable[[list[dict[str, np.ndarray]]], Any],
  stopped: Callable[[], bool] = lambda: False,
) -> list[dict[str, float]] | None:
  """Validation loss, perplexity and bits per byte over `train.eval_batches` batches read
  from the start of the eval split (the same batches every time), for each run of `configs`:
  one run, or the seeds of a vmapped run, whose batches `put_batch` stacks along the seed
  axis that `eval_fn` maps over. None: `stopped()` became true (a stop signal), and the
  evaluation was abandoned, before its next batch.

  `data.worker_count` shards are read by threads, not worker processes (the same batches):
  processes started for every evaluation would take seconds each to start, and a stop signal
  sent to the process group kills those still starting."""
  if stopped():
    return None
  iterators = [
    make_lm_iterator(c.data, tokenizer, split=c.data.eval_split, shuffle=False, worker_threads=True) for c in configs
  ]
  totals = {k: np.zeros(len(configs)) for k in ("nll_sum", "tokens", "bytes")}
  try:
    for _ in range(configs[0].train.eval_batches):
      batch = put_batch([next(iterator) for iterator in iterators])
      if stopped():
        return None
      sums = jax.device_get(eval_fn(params, batch))
      totals = {k: totals[k] + np.reshape(sums[k], -1) for k in totals}
  finally:
    for iterator in iterators:
      iterator.close()
  return [summarize({k: float(v[index]) for k, v in totals.items()}) for index in range(len(configs))]


def resumed_elapsed(workdir: str, resumed_step: int | None) -> float | None:
  """The training seconds a run had spent before this start: 0 for a fresh run, else the
  `elapsed_s` of the resumed step's train record, or None when that record has none."""
  if resumed_step is None:
    return 0.0
  path = os.path.join(workdir, METRICS_NAME)
  record = read_metrics(path).get(resumed_step, {}) if os.path.isfile(path) else {}
  return record.get("elapsed_s")


@dataclasses.dataclass
class RunOutput:
  """Where the step records of one run (or of one seed of a run of several) go.

  elapsed_base: the run's training seconds before this start (`resumed_elapsed`); None:
  unknown, and its records then carry no `elapsed_s`. label: "" for a single run; the seed
  and its workdir, which name it in a divergence error."""

  writer: MetricsWriter
  checkpointer: Checkpointer
  elapsed_base: float | None
  label: str = ""


class StepLogger:
  """Fetches the pending step metrics at log steps, checks them, adds throughput and the
  elapsed training time, and writes them to metrics.jsonl, TensorBoard and the console.

  One logger serves one run, or the seeds of a vmapped run of several (`train.seeds`): then
  each metric has a leading seed axis, seed k's records go to `outputs[k]` (`tokens_per_sec`
  is the seed's own, `mfu` the device's for all seeds together) and one console line
  summarizes the seeds.

  `elapsed_s`, in every record: the run's wall-clock seconds of training (compilation and
  checkpoint saves included, evaluation not), summed over its resumed starts.
  """

  def __init__(self, run: Run, outputs: list[RunOutput], start_step: int, resumed_step: int | None):
    t = run.config.train
    self._outputs, self._resumed_step = outputs, resumed_step
    self._is_main = jax.process_index() == 0
    self._window = ThroughputWindow(run.flops_per_token, peak_flops_per_device(), jax.device_count())
    self._pending: list[tuple[int, Any, float]] = []  # (step, metrics on device, data wait s)
    self._start, self._excluded = time.perf_counter(), 0.0
    self.progress = tqdm.tqdm(
      total=t.steps, initial=start_step, disable=not (t.progress_bar and self._is_main), unit="step", dynamic_ncols=True
    )

  @property
  def _several(self) -> bool:
    return bool(self._outputs[0].label)

  def add(self, step: int, metrics: Any, data_wait_s: float) -> None:
    self._pending.append((step, metrics, data_wait_s))

  def has_pending(self) -> bool:
    return bool(self._pending)

  def _write(self, step: int, split: str, records: list[dict[str, float]], elapsed: float) -> None:
    for output, record in zip(self._outputs, records):
      if output.elapsed_base is not None:
        record["elapsed_s"] = output.elapsed_base + elapsed
      output.writer.write(step, split, record)

  def log_train(self, step: int) -> list[dict[str, float]]:
    fetched = jax.device_get([m for _, m, _ in self._pending])
    records = []
    for (s, _, wait), m in zip(self._pending, fetched):
      records = [{k: float(np.reshape(v, -1)[i]) for k, v in m.items()} for i in range(len(self._outputs))]
      for output, record in zip(self._outputs, records):
        _check_finite(s, record, output.checkpointer, self._resumed_step, output.label)
      self._window.add(sum(record["input_tokens"] for record in records), wait)
    self._pending = []
    throughput = self._window.summary()
    self._window.reset()
    for record in records:
      record.update(throughput, tokens_per_sec=throughput["tokens_per_sec"] / len(records))
    self._write(step, "train", records, time.perf_counter() - self._start - self._excluded)
    loss = float(np.mean([record["loss"] for record in records]))
    self.progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{throughput['tokens_per_sec']:.0f}")
    if self._is_main:
      line = (
        format_seeds_train_line(step, records, throughput) if self._several else format_train_line(step, records[0])
      )
      self.progress.write(line)
    return records

  def log_eval(self, step: int, records: list[dict[str, float]], seconds: float) -> None:
    """`records` of an evaluation that took `seconds` (not training time) after `step`."""
    elapsed = time.perf_counter() - self._start - self._excluded - seconds
    self._window.exclude(seconds)
    self._excluded += seconds
    self._write(step, "eval", records, elapsed)
    if self._is_main:
      self.progress.write(
        format_seeds_eval_line(step, records) if self._several else format_eval_line(step, records[0])
      )

  def close(self) -> None:
    self.progress.close()


@dataclasses.dataclass
class RunIO:
  """What the loop does besides the compiled step, for one run or for the seeds of a vmapped
  run of several (`train.seeds`), one entry of `configs`, `train_iters` and `checkpointers`
  per run: read the batches, evaluate, save the checkpoints.

  put_batch: the runs' local batches -> the step's global batch (stacked for seeds).
  state_of: (the step's state, k) -> run k's train state, as its checkpoint holds it.
  checkpoint_name: step -> the saved checkpoint's directory, for messages.
  """

  configs: list[ml_collections.ConfigDict]
  tokenizer: Tokenizer
  train_iters: list[Any]
  checkpointers: list[Checkpointer]
  put_batch: Callable[[list[dict[str, np.ndarray]]], Any]
  state_of: Callable[[TrainState, int], TrainState]
  step_fn: Callable[[TrainState, Any], tuple[TrainState, Any]]
  eval_fn: Callable[[Any, Any], Any]
  logger: StepLogger
  checkpoint_name: Callable[[int], str]

  def next_batch(self):
    return self.put_batch([next(iterator) for iterator in self.train_iters])

  def evaluate(self, params, stopped: Callable[[], bool] = lambda: False) -> list[dict[str, float]] | None:
    return evaluate(params, self.eval_fn, self.configs, self.tokenizer, self.put_batch, stopped)

  def save(self, step: int, state: TrainState) -> None:
    for index, (checkpointer, iterator) in enumerate(zip(self.checkpointers, self.train_iters)):
      checkpointer.save(step, self.state_of(state, index), iterator)

  def wait(self) -> None:
    for checkpointer in self.checkpointers:
      checkpointer.wait()


def one_run_io(
  run: Run,
  shardings: TrainState,
  train_iter,
  checkpointer: Checkpointer,
  logger: StepLogger,
  frozen: dict[str, Any] | None,
) -> RunIO:
  """The `RunIO` of a single run; `frozen`: the family's frozen parameters, or None."""
  step_fn = jit_train_step(
    **step_options(run),
    state_shardings=shardings,
    batch_sharding=run.batch_sharding,
    seed=run.config.seed,
    frozen=frozen,
  )
  compiled_eval = jax.jit(eval_step_fn(run))
  return RunIO(
    configs=[run.config],
    tokenizer=run.tokenizer,
    train_iters=[train_iter],
    checkpointers=[checkpointer],
    put_batch=lambda batches: global_batch(batches[0], run.batch_sharding),
    state_of=lambda state, index: state,
    step_fn=step_fn,
    eval_fn=lambda params, batch: compiled_eval(with_frozen(params, frozen), batch),
    logger=logger,
    checkpoint_name=checkpointer.step_dir,
  )


def step_options(run: Run) -> dict[str, Any]:
  """The train step's settings of the run (`train.step.jit_train_step`'s keywords)."""
  return dict(
    model=run.model,
    tx=run.tx,
    schedule=run.schedule,
    pad_id=run.tokenizer.pad_id,
    grad_accum_steps=run.config.train.grad_accum_steps,
  )


def eval_step_fn(run: Run) -> Callable:
  """`eval_step` of the run's model: (params, batch) -> sums."""
  return functools.partial(
    eval_step,
    model=run.model,
    pad_id=run.tokenizer.pad_id,
    token_byte_lengths=jnp.asarray(run.tokenizer.token_byte_lengths, jnp.float32),
    microbatches=run.config.train.grad_accum_steps,
  )


def run_loop(
  run: Run, state: TrainState, io: RunIO, stop: StopSignals, after_step: Callable[[int], None] | None
) -> tuple[TrainState, list[dict[str, float]], list[dict[str, float]]]:
  """Steps from the state's step to `train.steps`: fetch, step, log, eval, save. Returns the
  final state and the last train and eval records (one per run of `io`)."""
  t = run.config.train
  start_step = int(np.reshape(jax.device_get(state.step), -1)[0])
  logger = io.logger
  # Several processes agree on when to stop; one reads its own signal.
  vote = StopVote(run.mesh) if jax.process_count() > 1 else None
  stop.finished_step = start_step
  last_train, last_eval = [], []
  previous_metrics = None
  # One process gives up an evaluation as soon as it is signaled; several processes evaluate
  # together (collectives), so they finish it and stop at the step their vote agrees on.
  eval_stopped = (lambda: stop.requested is not None) if vote is None else (lambda: False)
  try:
    for step in range(start_step + 1, t.steps + 1):
      # The previous step is still running on the device while the host reads this batch.
      fetch_start = time.perf_counter()
      batch = io.next_batch()
      data_wait = time.perf_counter() - fetch_start
      ballot = vote.cast(stop.requested) if vote is not None else None
      state, metrics = io.step_fn(state, batch)
      logger.add(step, metrics, data_wait)
      # At most this step and the previous one on the device: the host never runs further
      # ahead, so a signal is acted on within about a step whatever train.log_every is.
      if previous_metrics is not None:
        jax.block_until_ready(previous_metrics)
        stop.finished_step = step - 1
      previous_metrics = metrics
      is_last = step == t.steps
      save_now = is_last or (t.checkpoint_every > 0 and step % t.checkpoint_every == 0)
      log_now = step % t.log_every == 0 or save_now or step == start_step + 1
      if log_now:
        last_train = logger.log_train(step)
      # A stop skips the evaluation, and one during it abandons it: the checkpoint comes first (a
      # scheduler's grace period is short).
      signum = stop.requested if vote is None else StopVote.result(ballot)
      abandoned_eval = False
      if signum is None and t.eval_batches > 0 and (is_last or (t.eval_every > 0 and step % t.eval_every == 0)):
        jax.block_until_ready(metrics)  # the step's time is training time, not evaluation
        eval_start = time.perf_counter()
        records = io.evaluate(state.params, eval_stopped)
        abandoned_eval = records is None
        if not abandoned_eval:
          last_eval = records
          logger.log_eval(step, last_eval, time.perf_counter() - eval_start)
      if save_now:
        io.save(step, state)
      logger.progress.update(1)
      if after_step is not None:
        after_step(step)
      if vote is None:
        signum = stop.requested
      if signum is not None:  # SIGINT/SIGTERM: keep this step (if finite), then stop
        if logger.has_pending():
          last_train = logger.log_train(step)
        if not save_now:
          io.save(step, state)
        io.wait()
        during = stop.signaled_during if stop.requested else None
        raise TrainingInterrupted(signum, step, io.checkpoint_name(step), during, abandoned_eval)
  finally:
    logger.close()
  return state, last_train, last_eval


def open_metrics(workdir: str, resumed_step: int | None) -> MetricsWriter:
  """The run's metrics writer, from the step after `resumed_step` on (a note says which
  records of a run that got further were set aside)."""
  first_step = 0 if resumed_step is None else resumed_step + 1
  writer = MetricsWriter(workdir, first_step=first_step)
  if writer.set_aside:
    note_line(
      f"{os.path.join(workdir, METRICS_NAME)}: moved {writer.set_aside} record(s) of the steps this run logs again "
      f"(from step {first_step} on) to {SET_ASIDE_NAME}"
    )
  return writer


def train(
  config: ml_collections.ConfigDict, *, after_step: Callable[[int], None] | None = None
) -> TrainResult | list[TrainResult]:
  """Runs (or resumes) training as described by `config`.

  Args:
    config: a config from `configs/` (see train/config.py for every field).
    after_step: called with the step number after each step (tests use it to
      interrupt a run).

  Returns:
    The final state and the last train/eval metrics; with `train.seeds`, a list of them,
    one per seed (`train.seeds.train_seeds`).

  Raises:
    TrainingInterrupted: on SIGINT/SIGTERM, after saving a checkpoint.
    TrainingDivergedError, CheckpointError, WorkdirBusyError, WorkdirNotEmptyError,
    ConfigMismatchError, ValueError: with a message naming the setting to change.
  """
  if config.train.get("seeds") is not None:
    from train.seeds import train_seeds  # it builds on this module

    return train_seeds(config, after_step=after_step)
  clock = PhaseClock()
  with clock.phase("model and mesh"):
    run = build_run(config)
  config = run.config  # with the settings build_run adjusted (a clipped warm-up)
  lock, checkpointer = open_workdir(run)
  writer = train_iter = None
  try:
    with contextlib.ExitStack() as stack:
      stop = stack.enter_context(StopSignals())
      stack.enter_context(jax.set_mesh(run.mesh))
      stack.enter_context(nn.logical_axis_rules(LOGICAL_AXIS_RULES))
      abstract_state, shardings = state_shardings(run.model, run.tx, run.mesh, config.data.seq_len)
      frozen = load_frozen_params(run)
      with clock.phase("data"):
        train_iter = make_lm_iterator(
          config.data, run.tokenizer, split=config.data.train_split, shuffle=True, prefetch=config.data.prefetch
        )
      with clock.phase("parameters"):
        state, resumed_step, init_source = restore_or_init(run, checkpointer, abstract_state, shardings, train_iter)
        jax.block_until_ready(state)
      write_run_files(run.workdir, config)
      writer = open_metrics(run.workdir, resumed_step)
      if init_source is not None:  # config.json names the workdir; this record, the step used
        writer.write(0, "init_from", {"source_step": init_source.step})
      if frozen is not None:
        recorded = frozen_record(run.workdir)
        if resumed_step is not None and recorded and recorded.get("fingerprint") != frozen.fingerprint:
          raise ConfigMismatchError(
            f"The checkpoints in {run.workdir} were trained against other frozen parameters ({recorded}); "
            f"{frozen.workdir} step {frozen.step} has fingerprint {frozen.fingerprint}. Point the run at the "
            "same source (e.g. model.family_kwargs.target_step), or start over in a new --workdir"
          )
        write_frozen_record(run.workdir, source=frozen.workdir, step=frozen.step, fingerprint=frozen.fingerprint)
      start = describe_start(checkpointer, resumed_step, init_source, config.seed)
      report_line(startup_banner(run, abstract_state, start, frozen, ready=clock.describe()))
      output = RunOutput(writer, checkpointer, resumed_elapsed(run.workdir, resumed_step))
      logger = StepLogger(run, [output], int(jax.device_get(state.step)), resumed_step)
      io = one_run_io(run, shardings, train_iter, checkpointer, logger, None if frozen is None else frozen.params)
      state, last_train, last_eval = run_loop(run, state, io, stop, after_step)
  finally:
    try:
      if train_iter is not None:
        train_iter.close()
      checkpointer.close()
      if writer is not None:
        writer.close()
    finally:
      if lock is not None:
        lock.release()
  final_step = int(jax.device_get(state.step))
  report_line(
    f"Finished step {final_step} of {config.train.steps}; saved checkpoint {checkpointer.step_dir(final_step)}"
  )
  return TrainResult(state, last_train[0] if last_train else {}, last_eval[0] if last_eval else {})
