"""Timing, memory, table and JSON-record functions shared by the benchmark scripts (each runs
from the repository root as `python -m benchmarks.<name>`).

The per-op harnesses (`castle_attention`, `power_attention`, `gca_attention`,
`tree_attention`) time every implementation of their op's table (`kernel_implementations`)
next to cuDNN attention in the same process, and take `--smoke` (`smoke_mode`): tiny shapes
on whatever device there is, the kernels in interpret mode on a CPU, so that CI runs them.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

# GPU interpret mode runs each Mosaic GPU warpgroup as a thread; with more warpgroups than
# CPU cores XLA's intra-op pool can starve one unless this scheduler is off (read when jax
# starts its backend, so `smoke_mode` sets it before the first computation).
_INTERPRET_XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def smoke_mode() -> None:
  """Prepares a --smoke run: the XLA flag the Mosaic kernels' interpret mode needs on a CPU."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _INTERPRET_XLA_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_INTERPRET_XLA_FLAG}".strip()


def implementations_to_time(implementations: Sequence[str]) -> str:
  """The default --impls of a per-op harness: every implementation of the op's table but the
  O(T^2)-memory "reference" oracle."""
  return ",".join(name for name in implementations if name != "reference")


def kernel_config_specs(text: str, config_types: dict[str, type]) -> dict[str, list[tuple[str, object]]]:
  """{implementation: [(its key=value text, config), ...]} from --kernel_configs
  "impl:key=value,...;impl:..." (an empty config after "impl:" is that implementation's
  default); `config_types` is the op's KERNEL_CONFIGS."""
  configs = {}
  for entry in filter(None, (part.strip() for part in text.split(";"))):
    impl, sep, spec = entry.partition(":")
    if not sep or impl not in config_types:
      raise ValueError(
        f"--kernel_configs entries are 'impl:key=value,...' with impl in {tuple(config_types)}, got {entry!r}"
      )
    configs.setdefault(impl, []).append((spec, config_types[impl].from_string(spec)))
  return configs


def kernel_configs(text: str, config_types: dict[str, type]) -> dict[str, list]:
  """{implementation: [config, ...]} from --kernel_configs (see `kernel_config_specs`)."""
  return {impl: [config for _, config in pairs] for impl, pairs in kernel_config_specs(text, config_types).items()}


# The columns every per-op table has: times, rates (model FLOPs) and the compiled program's peak.
TIME_COLUMNS = (
  ("fwd ms", "fwd_ms", ".2f"),
  ("fwd+bwd ms", "fwd_bwd_ms", ".2f"),
  ("fwd TFLOP/s", "fwd_tflops", ".1f"),
  ("fwd+bwd TFLOP/s", "fwd_bwd_tflops", ".1f"),
)
PEAK_COLUMN = ("peak GiB", "peak_gib", ".2f")


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> None:
  """A markdown table of `rows`: `columns` are (header, row key, format spec); a row with an
  "error" shows it after its first column, a missing value shows as "-"."""
  print("| " + " | ".join(header for header, _, _ in columns) + " |")
  print("|" + " --- |" * len(columns))
  for row in rows:
    cells = []
    for header, key, spec in columns:
      del header
      value = row.get(key)
      cells.append("-" if value is None else format(value, spec))
    if "error" in row:
      cells = [cells[0], row["error"]]
    print("| " + " | ".join(cells) + " |")


def median_ms(fn: Callable, args_sets: Sequence[tuple], iters: int) -> float:
  """Median wall time of fn(*args) in ms, after one warm-up call per input set.

  Cycles through `args_sets` so that no two consecutive calls see the same buffers.
  """
  for args in args_sets[:2]:
    jax.block_until_ready(fn(*args))
  times = []
  for i in range(iters):
    args = args_sets[i % len(args_sets)]
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def step_times(
  step: Callable, state, extra_inputs: Sequence, iters: int, first_call: Callable[[float], None] | None = None
) -> tuple[list[float], object]:
  """(seconds of each of `iters` calls, the state after them) of a step that carries its
  state: (out, state) = step(state, *extra_inputs), each call fed the state the previous one
  returned (so a step that donates its state updates it in place), after two warm-up calls
  (the first compiles). `first_call`, if given, gets the seconds the first call took, its
  compilation included."""
  for warmup in range(2):
    start = time.perf_counter()
    out, state = step(state, *extra_inputs)
    if warmup == 0 and first_call is not None:
      jax.block_until_ready(out)
      first_call(time.perf_counter() - start)
  jax.block_until_ready(out)
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    out, state = step(state, *extra_inputs)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  return times, state


def median_step_ms(
  step: Callable, state, extra_inputs: Sequence, iters: int, first_call: Callable[[float], None] | None = None
) -> float:
  """Median wall time in ms of `step_times`' calls."""
  return 1e3 * statistics.median(step_times(step, state, extra_inputs, iters, first_call)[0])


def tree_bytes(tree) -> int:
  """The bytes of a pytree's arrays (e.g. a decoding cache)."""
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


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
