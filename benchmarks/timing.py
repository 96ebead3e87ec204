"""Timing, memory and JSON-record helpers shared by the benchmark scripts (each runs from the
repository root as `python -m benchmarks.<name>`)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Callable, Sequence

import jax


def median_ms(fn: Callable, args_sets: Sequence[tuple], iters: int) -> float:
  """Median wall time of fn(*args) in ms, after one warm-up call per input set.

  Cycles through `args_sets` so that no two consecutive calls see the same buffers.
  """
  import jax

  for args in args_sets[:2]:
    jax.block_until_ready(fn(*args))
  times = []
  for i in range(iters):
    args = args_sets[i % len(args_sets)]
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def torch_median_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
  """The same for a PyTorch callable on CUDA (synchronizing after each call)."""
  import torch

  for _ in range(warmup):
    fn()
  torch.cuda.synchronize()
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def peak_bytes(compiled) -> int | None:
  """Peak memory of a compiled program: temporaries + arguments + outputs - aliased, or None."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # not every backend reports it
    return None
  if stats is None:
    return None
  return int(
    stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
  )


def error_text(e: Exception) -> str:
  """One short line for a failed benchmark row."""
  return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def time_forward_and_gradients(fn: Callable, num_inputs: int, args_sets: Sequence[tuple], iters: int) -> dict:
  """fwd_ms, fwd_bwd_ms (gradients of the first `num_inputs` arguments) and peak_gib of fn.

  Each args tuple is (*inputs, cotangent); the backward differentiates sum(fn(*inputs) *
  cotangent). A failure is reported as {"error": ...} so that one row cannot lose the others.
  """
  import jax
  import jax.numpy as jnp

  forward = jax.jit(lambda *a: fn(*a[:-1]))

  def loss(*a):
    return jnp.sum(fn(*a[:-1]).astype(jnp.float32) * a[-1].astype(jnp.float32))

  backward = jax.jit(jax.grad(loss, argnums=tuple(range(num_inputs))))
  try:
    compiled = backward.lower(*args_sets[0]).compile()
    return {
      "fwd_ms": median_ms(forward, args_sets, iters),
      "fwd_bwd_ms": median_ms(compiled, args_sets, iters),
      "peak_gib": (peak_bytes(compiled) or 0) / 2**30,
    }
  except Exception as e:  # report and go on
    return {"error": error_text(e)}


def run_meta(**options) -> dict:
  """The header of a run's JSON record: device, jax version, the run's options, date."""
  return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, **options, "date": time.strftime("%Y-%m-%d")}


def write_json(path: str | None, meta: dict, **sections) -> None:
  """Writes {"meta": meta, **sections} to `path` (nothing when path is None)."""
  if path:
    with open(path, "w") as f:
      json.dump({"meta": meta, **sections}, f, indent=1)
