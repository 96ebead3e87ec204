"""The jitted, sharded train step of a config timed on synthetic tokens (no input pipeline):
`measure`, the per-op GPU time of a trace and the overlap of compute and collectives in it
(`timeline_breakdown`), shared by train_throughput.py, train_loop.py and multi_gpu.py."""

from __future__ import annotations

import collections
import glob
import os
import statistics
import tempfile
import time
from typing import Callable

import flax.linen as nn
import jax
import numpy as np

from castle_jax.models import ModelConfig, build_model, count_parameters, training_flops_per_token
from castle_jax.sharding import LOGICAL_AXIS_RULES
from train.mesh import make_mesh
from train.optimizer import make_optimizer
from train.state import init_train_state, state_shardings
from train.step import jit_train_step
from train.throughput import peak_flops_per_device


def measure(
  config,
  steps: int,
  profile_dir: str | None = None,
  token_ids: int | None = None,
  host_batches: list[dict] | None = None,
) -> dict:
  """Times `steps` train steps of `config` (median, after 2 warm-up steps) on random tokens.

  Args:
    token_ids: draw tokens from [0, token_ids) (default: the whole vocabulary). Real text
      uses a few hundred ids of a 50K vocabulary (all of them with the byte tokenizer),
      which makes the embedding gradient's scatter-add collide far more than uniform ids do.
    host_batches: time on these {"inputs", "targets"} batches (e.g. from the real input
      pipeline, already read) instead of random tokens.
    profile_dir: also trace 2 more steps there.
  """
  model_config = ModelConfig.from_mapping(config.model)
  model = build_model(model_config)
  mesh = make_mesh(config.mesh)
  tx, schedule = make_optimizer(config.train)
  seq_len, batch = config.data.seq_len, config.data.batch_size
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
  rng = np.random.default_rng(0)
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    _, shardings = state_shardings(model, tx, mesh, seq_len)
    state = init_train_state(model, tx, jax.random.key(0), seq_len, shardings)
    step = jit_train_step(
      model=model,
      tx=tx,
      schedule=schedule,
      pad_id=-1,
      grad_accum_steps=config.train.grad_accum_steps,
      state_shardings=shardings,
      batch_sharding=batch_sharding,
    )
    # Several distinct batches, so repeated steps do not replay one buffer.
    if host_batches is None:
      host_batches = []
      for _ in range(3):
        tokens = rng.integers(0, token_ids or model_config.vocab_size, (batch, seq_len + 1), dtype=np.int32)
        host_batches.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    batches = [jax.device_put(b, batch_sharding) for b in host_batches[:3]]
    compile_start = time.perf_counter()
    for i in range(2):
      state, metrics = step(state, batches[i % 3])
    jax.block_until_ready(metrics)
    warmup_s = time.perf_counter() - compile_start
    times = []
    for i in range(steps):
      start = time.perf_counter()
      state, metrics = step(state, batches[i % 3])
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)
    if profile_dir:
      with jax.profiler.trace(profile_dir):
        for i in range(2):
          state, metrics = step(state, batches[i % 3])
        jax.block_until_ready(metrics)
  step_s = statistics.median(times)
  tokens_per_s = batch * seq_len / step_s
  flops_per_token = training_flops_per_token(model_config, seq_len)
  peak = peak_flops_per_device()
  memory = jax.devices()[0].memory_stats() or {}
  return {
    "device": jax.devices()[0].device_kind,
    "devices": mesh.devices.size,
    "jax": jax.__version__,
    "attention": model_config.attention,
    "attention_impl": model_config.attention_impl,
    "params": count_parameters(model_config),
    "seq_len": seq_len,
    "batch": batch,
    "grad_accum_steps": config.train.grad_accum_steps,
    "dtype": model_config.dtype,
    "step_s_median": step_s,
    "step_s_min": min(times),
    "step_s_max": max(times),
    "warmup_s": warmup_s,
    "tokens_per_s": tokens_per_s,
    # Per device of the mesh, which may use fewer devices than the host has (a 1-device row of
    # the multi-GPU scaling runs beside the N-device rows).
    "model_tflops_per_s_per_device": tokens_per_s * flops_per_token / mesh.devices.size / 1e12,
    "mfu": None if peak is None else tokens_per_s * flops_per_token / (peak * mesh.devices.size),
    "peak_bytes_in_use": memory.get("peak_bytes_in_use"),
    "final_loss": float(metrics["loss"]),
    "token_ids": token_ids or model_config.vocab_size,
  }


def device_time_by_op(profile_dir: str, top: int | None = 25) -> list[tuple[str, str, float, int]]:
  """(line, op or kernel name, total ms, count) of the device planes of a trace, largest first
  (the `top` largest; None: all).

  Reads the "XLA Ops"/"XLA Modules" lines where the trace has them; traces from the CUDA
  plugin of jax 0.11.2 have only per-stream lines ("Stream #N(...)") of kernel names.
  """
  paths = glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True)
  planes = [
    p
    for p in jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime)).planes
    if p.name.startswith("/device:")
  ]
  lines = [(plane, line) for plane in planes for line in plane.lines]
  wanted = [(plane, line) for plane, line in lines if line.name in ("XLA Ops", "XLA Modules")]
  wanted = wanted or [(plane, line) for plane, line in lines if line.name.startswith("Stream")]
  totals = collections.defaultdict(lambda: [0.0, 0])
  for _, line in wanted:
    label = "stream" if line.name.startswith("Stream") else line.name
    for event in line.events:
      entry = totals[(label, event.name)]
      entry[0] += event.duration_ns / 1e6
      entry[1] += 1
  if not totals:
    print(f"no device op lines in the trace; planes/lines found: {sorted((p.name, ln.name) for p, ln in lines)[:40]}")
  rows = sorted(((label, n, ms, c) for (label, n), (ms, c) in totals.items()), key=lambda r: -r[2])
  return rows[:top]


def kernel_times_per_call(run_once: Callable[[], None], calls: int, top: int) -> dict:
  """Traces `calls` runs of `run_once` (each blocks until its outputs are ready) and returns,
  per call: "ops_ms", device milliseconds of the `top` kernels that take the most; "device_ms",
  the sum over every kernel (below the wall time by the gaps between kernels, above it where
  kernels of several streams overlap); "kernels", the launches. Empty where the trace has no
  device lines (a CPU)."""
  with tempfile.TemporaryDirectory(prefix="kernel_times_") as directory:
    with jax.profiler.trace(directory):
      for _ in range(calls):
        run_once()
    # The "XLA Modules" line, where a trace has one, spans the ops it runs: not summed.
    ops = [op for op in device_time_by_op(directory, top=None) if op[0] != "XLA Modules"]
  if not ops:
    return {}
  return {
    "ops_ms": {name: ms / calls for _, name, ms, _ in ops[:top]},
    "device_ms": sum(ms for _, _, ms, _ in ops) / calls,
    "kernels": sum(count for *_, count in ops) / calls,
  }


def _union_ns(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Sorted, disjoint cover of [start, end) intervals."""
  merged: list[tuple[int, int]] = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def _covered_ns(intervals: list[tuple[int, int]]) -> int:
  return sum(end - start for start, end in intervals)


def _minus_ns(cover: list[tuple[int, int]], holes: list[tuple[int, int]]) -> int:
  """Length of `cover` outside `holes` (both disjoint and sorted)."""
  total, j = 0, 0
  for start, end in cover:
    position = start
    while j < len(holes) and holes[j][1] <= position:
      j += 1
    k = j
    while position < end:
      if k < len(holes) and holes[k][0] < end:
        total += max(0, holes[k][0] - position)
        position = max(position, holes[k][1])
        k += 1
      else:
        total += end - position
        position = end
  return total


def busy_breakdown(kernels: list[tuple[int, int, bool]], steps: int) -> dict[str, float]:
  """Per-step milliseconds of one device's kernels [(start_ns, end_ns, is_collective)]:
  `span` (first start to last end), `compute` and `collective` (time some kernel of that kind
  runs), `exposed_collective` (a collective runs and no compute kernel does: the time data
  parallelism adds when nothing hides it) and `idle` (no kernel at all: launch or host gaps)."""
  compute = _union_ns([(s, e) for s, e, c in kernels if not c])
  collective = _union_ns([(s, e) for s, e, c in kernels if c])
  every = _union_ns([(s, e) for s, e, _ in kernels])
  span = (every[-1][1] - every[0][0]) if every else 0
  per_step = lambda ns: ns / 1e6 / steps  # noqa: E731
  return {
    "span": per_step(span),
    "compute": per_step(_covered_ns(compute)),
    "collective": per_step(_covered_ns(collective)),
    "exposed_collective": per_step(_minus_ns(collective, compute)),
    "idle": per_step(span - _covered_ns(every)),
  }


COLLECTIVE_KERNEL_MARKERS = ("nccl", "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def timeline_breakdown(profile_dir: str, steps: int) -> dict[str, dict[str, float]]:
  """`busy_breakdown` of every GPU in the newest trace under profile_dir (kernel events of
  its "Stream" lines; NCCL kernels are the collectives), keyed by device plane name."""
  paths = glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True)
  result = {}
  for plane in jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime)).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    kernels = [
      (e.start_ns, e.end_ns, any(m in e.name.lower() for m in COLLECTIVE_KERNEL_MARKERS))
      for line in plane.lines
      if line.name.startswith("Stream")
      for e in line.events
    ]
    if kernels:
      result[plane.name] = busy_breakdown(kernels, steps)
  return result
