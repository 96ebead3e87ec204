"""Timing and memory helpers shared by the benchmark scripts (run from the repo root as
`python benchmarks/<name>.py`, which puts this folder on sys.path)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence


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
  return int(stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes)
