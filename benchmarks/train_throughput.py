"""Training throughput and MFU of a config's train step, on synthetic tokens.

    python benchmarks/train_throughput.py --config=configs/baseline_s.py --steps=20 \
        [--config.train.grad_accum_steps=8] [--json=out.json]

Times the same jitted, sharded train step that `python -m train` runs (gradient
accumulation included), fed with random tokens so the input pipeline is not
measured. MFU = model FLOPs per token (6 x matmul parameters + causal attention
core, see `training_flops_per_token`) x tokens/s / datasheet bf16 peak.
Prints a one-line table last and optionally writes JSON.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import time

import flax.linen as nn
import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from castle_jax.models import ModelConfig, build_model, count_parameters, training_flops_per_token
from castle_jax.sharding import LOGICAL_AXIS_RULES
from train.mesh import make_mesh
from train.optimizer import make_optimizer
from train.state import init_train_state, state_shardings
from train.step import jit_train_step
from train.throughput import peak_flops_per_device

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (after 2 warm-up steps).")
_JSON = flags.DEFINE_string("json", None, "Write the results here as JSON.")
_PROFILE = flags.DEFINE_string("profile", None, "Trace 2 more steps into this directory and print GPU time by op.")


def measure(config, steps: int, profile_dir: str | None = None) -> dict:
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
    step = jit_train_step(model=model, tx=tx, schedule=schedule, pad_id=-1,
                          grad_accum_steps=config.train.grad_accum_steps, state_shardings=shardings,
                          batch_sharding=batch_sharding)
    # Several distinct batches, so repeated steps do not replay one buffer.
    batches = []
    for _ in range(3):
      tokens = rng.integers(0, model_config.vocab_size, (batch, seq_len + 1), dtype=np.int32)
      batches.append(jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, batch_sharding))
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
      "devices": jax.device_count(),
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
      "model_tflops_per_s_per_device": tokens_per_s * flops_per_token / jax.device_count() / 1e12,
      "mfu": None if peak is None else tokens_per_s * flops_per_token / (peak * jax.device_count()),
      "peak_bytes_in_use": memory.get("peak_bytes_in_use"),
      "final_loss": float(metrics["loss"]),
  }


def device_time_by_op(profile_dir: str, top: int = 25) -> list[tuple[str, str, float, int]]:
  """(line, op name, total ms, count) of the device planes of a trace, largest first."""
  paths = glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True)
  totals = collections.defaultdict(lambda: [0.0, 0])
  for plane in jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime)).planes:
    if not plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      if line.name not in ("XLA Ops", "XLA Modules"):
        continue
      for event in line.events:
        entry = totals[(line.name, event.name)]
        entry[0] += event.duration_ns / 1e6
        entry[1] += 1
  if not totals:
    names = {(p.name, l.name) for p in jax.profiler.ProfileData.from_file(max(paths, key=os.path.getmtime)).planes
             for l in p.lines}
    print(f"no 'XLA Ops'/'XLA Modules' lines in the trace; planes/lines found: {sorted(names)[:40]}")
  rows = sorted(((l, n, ms, c) for (l, n), (ms, c) in totals.items()), key=lambda r: -r[2])
  return rows[:top]


def main(argv):
  del argv
  result = measure(_CONFIG.value, _STEPS.value, _PROFILE.value)
  if _PROFILE.value:
    for line, name, ms, count in device_time_by_op(_PROFILE.value):
      print(f"{line:12s} {ms / 2:9.2f} ms/step  x{count // 2:<5d} {name[:110]}")
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=2)
  mfu = "n/a" if result["mfu"] is None else f"{result['mfu']:.1%}"
  peak_gb = (result["peak_bytes_in_use"] or 0) / 2**30
  print(f"| {result['device']} x{result['devices']} | {result['params'] / 1e6:.1f}M params | T={result['seq_len']} "
        f"| batch {result['batch']} (accum {result['grad_accum_steps']}) | {result['step_s_median'] * 1e3:.1f} ms/step "
        f"| {result['tokens_per_s']:.0f} tok/s | {result['model_tflops_per_s_per_device']:.1f} TFLOP/s | MFU {mfu} "
        f"| peak {peak_gb:.1f} GiB |")


if __name__ == "__main__":
  app.run(main)
