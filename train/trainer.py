"""The training loop: sharded state, jitted step, eval, metrics, Orbax checkpoints."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from castle_jax.data.pipeline import make_lm_iterator
from castle_jax.data.tokenizer import Tokenizer, load_tokenizer
from castle_jax.models import ModelConfig, build_model, training_flops_per_token
from castle_jax.sharding import LOGICAL_AXIS_RULES
from train.checkpointing import Checkpointer
from train.config import validate_keys
from train.mesh import data_parallel_size, make_mesh
from train.metrics import MetricsWriter
from train.optimizer import make_optimizer
from train.state import TrainState, init_train_state, state_shardings
from train.step import eval_step, jit_train_step
from train.throughput import peak_flops_per_device


class TrainingDivergedError(FloatingPointError):
  """The loss or gradient norm became NaN/inf; the last good checkpoint is kept."""


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  last_train_metrics: dict[str, float]
  last_eval_metrics: dict[str, float]


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
        "in every microbatch")
  if d.batch_size % jax.process_count():
    raise ValueError(f"data.batch_size ({d.batch_size}) must be divisible by the {jax.process_count()} processes")


def _global_batch(local_batch: dict[str, np.ndarray], sharding: jax.sharding.NamedSharding):
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def _check_finite(step: int, metrics: dict[str, float], checkpointer: Checkpointer) -> None:
  bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
  if bad:
    checkpointer.wait()
    raise TrainingDivergedError(
        f"Training diverged at step {step}: {bad}. No checkpoint was written from this point on; "
        f"the last good checkpoint is step {checkpointer.latest_step()} in {checkpointer.directory}. "
        "Lower train.learning_rate, raise train.warmup_steps or check the data, then resume.")


def evaluate(params, eval_fn: Callable, config: ml_collections.ConfigDict, tokenizer: Tokenizer,
             batch_sharding) -> dict[str, float]:
  """Validation loss, perplexity and bits per byte over `train.eval_batches` batches
  read from the start of the eval split (the same batches every time)."""
  iterator = make_lm_iterator(config.data, tokenizer, split=config.data.eval_split, shuffle=False)
  totals = {"nll_sum": 0.0, "tokens": 0.0, "bytes": 0.0}
  for _ in range(config.train.eval_batches):
    sums = jax.device_get(eval_fn(params, _global_batch(next(iterator), batch_sharding)))
    totals = {k: totals[k] + float(sums[k]) for k in totals}
  loss = totals["nll_sum"] / max(totals["tokens"], 1.0)
  return {
      "loss": loss,
      "perplexity": math.exp(min(loss, 80.0)),
      "bits_per_byte": totals["nll_sum"] / math.log(2) / max(totals["bytes"], 1.0),
  }


def train(config: ml_collections.ConfigDict, *,
          after_step: Callable[[int], None] | None = None) -> TrainResult:
  """Runs (or resumes) training as described by `config`.

  Args:
    config: a config from `configs/` (see train/config.py for every field).
    after_step: called with the step number after each step (tests use it to
      interrupt a run).

  Returns:
    The final state and the last train/eval metrics.
  """
  validate_keys(config)
  if not config.workdir:
    raise ValueError("config.workdir is empty: pass --workdir=DIR (checkpoints and metrics go there)")
  workdir = os.path.abspath(config.workdir)
  os.makedirs(workdir, exist_ok=True)
  t = config.train

  model_config = ModelConfig.from_mapping(config.model)
  tokenizer = load_tokenizer(config.data.tokenizer)
  if model_config.vocab_size < tokenizer.vocab_size:
    raise ValueError(
        f"model.vocab_size ({model_config.vocab_size}) is smaller than the tokenizer's vocabulary "
        f"({tokenizer.vocab_size}); raise model.vocab_size")
  mesh = make_mesh(config.mesh)
  _validate_batching(config, mesh)
  model = build_model(model_config)
  tx, schedule = make_optimizer(t)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))

  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
  flops_per_token = training_flops_per_token(model_config, config.data.seq_len)
  peak = peak_flops_per_device()
  writer = MetricsWriter(workdir)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints)
  is_main = jax.process_index() == 0

  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    abstract_state, shardings = state_shardings(model, tx, mesh, config.data.seq_len)
    train_iter = make_lm_iterator(config.data, tokenizer, split=config.data.train_split, shuffle=True)
    latest = checkpointer.latest_step() if t.resume else None
    if latest is not None:
      state = checkpointer.restore(latest, abstract_state, train_iter)
      if is_main:
        print(f"Resumed from step {latest} in {checkpointer.directory}", flush=True)
    else:
      state = init_train_state(model, tx, jax.random.key(config.seed), config.data.seq_len, shardings)
    start_step = int(jax.device_get(state.step))

    step_fn = jit_train_step(model=model, tx=tx, schedule=schedule, pad_id=tokenizer.pad_id,
                             grad_accum_steps=t.grad_accum_steps, state_shardings=shardings,
                             batch_sharding=batch_sharding)
    eval_fn = jax.jit(functools.partial(
        eval_step, model=model, pad_id=tokenizer.pad_id,
        token_byte_lengths=jnp.asarray(tokenizer.token_byte_lengths, jnp.float32)))

    progress = tqdm.tqdm(total=t.steps, initial=start_step, disable=not (t.progress_bar and is_main),
                         unit="step", dynamic_ncols=True)
    pending: list[tuple[int, dict]] = []  # metrics still on device, fetched at log/checkpoint steps
    last_train, last_eval = {}, {}
    window_start, window_tokens = time.perf_counter(), 0.0
    try:
      for step in range(start_step + 1, t.steps + 1):
        state, metrics = step_fn(state, _global_batch(next(train_iter), batch_sharding))
        pending.append((step, metrics))
        is_last = step == t.steps
        save_now = step % t.checkpoint_every == 0 or is_last
        if step % t.log_every == 0 or save_now or is_last or step == start_step + 1:
          fetched = jax.device_get(pending)
          pending = []
          for s, m in fetched:
            m = {k: float(v) for k, v in m.items()}
            _check_finite(s, m, checkpointer)
            window_tokens += m["tokens"]
          elapsed = time.perf_counter() - window_start
          last_train = dict(m)
          last_train["tokens_per_sec"] = window_tokens / elapsed
          if peak is not None:
            last_train["mfu"] = last_train["tokens_per_sec"] * flops_per_token / (peak * jax.device_count())
          writer.write(step, "train", last_train)
          progress.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{last_train['tokens_per_sec']:.0f}")
          if is_main:
            progress.write(f"step {step:6d} | loss {m['loss']:.4f} | grad_norm {m['grad_norm']:.3f} | "
                           f"lr {m['learning_rate']:.2e} | {last_train['tokens_per_sec']:.0f} tok/s"
                           + (f" | MFU {last_train['mfu']:.1%}" if "mfu" in last_train else ""))
          window_start, window_tokens = time.perf_counter(), 0.0
        if step % t.eval_every == 0 or is_last:
          last_eval = evaluate(state.params, eval_fn, config, tokenizer, batch_sharding)
          writer.write(step, "eval", last_eval)
          if is_main:
            progress.write(f"step {step:6d} | eval loss {last_eval['loss']:.4f} | "
                           f"ppl {last_eval['perplexity']:.2f} | {last_eval['bits_per_byte']:.4f} bits/byte")
          window_start = time.perf_counter()  # eval time is not training throughput
        if save_now:
          checkpointer.save(step, state, train_iter)
        progress.update(1)
        if after_step is not None:
          after_step(step)
    finally:
      progress.close()
      checkpointer.close()
      writer.close()
  return TrainResult(state, last_train, last_eval)
