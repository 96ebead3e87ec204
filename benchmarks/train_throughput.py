"""Training throughput and MFU of a config's train step, on synthetic tokens.

    python -m benchmarks.train_throughput --config=configs/baseline_s.py --steps=20 \
        [--config.train.grad_accum_steps=8] [--json=out.json]

Times the same jitted, sharded train step that `python -m train` runs (gradient
accumulation included), fed with random tokens so the input pipeline is not
measured. MFU = model FLOPs per token (6 x matmul parameters + causal attention
core, see `training_flops_per_token`) x tokens/s / datasheet bf16 peak.
Prints a one-line table last (with the time to compile the step and run it twice) and
optionally writes JSON.
"""

from __future__ import annotations

import json
import os

from absl import flags
from ml_collections import config_flags

from castle_jax.command_line import run_absl
from train.command_line import config_flags_parser

from benchmarks.synthetic_step import device_time_by_op, measure

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps (after 2 warm-up steps).", lower_bound=1)
_JSON = flags.DEFINE_string("json", None, "Write the results here as JSON (a new file).")
flags.register_validator("json", lambda path: path is None or not os.path.lexists(path), "exists: pass a new file name")
_PROFILE = flags.DEFINE_string("profile", None, "Trace 2 more steps into this directory and print GPU time by op.")


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
  print(
    f"| {result['device']} x{result['devices']} | {result['params'] / 1e6:.1f}M params | T={result['seq_len']} "
    f"| batch {result['batch']} (accum {result['grad_accum_steps']}) | {result['step_s_median'] * 1e3:.1f} ms/step "
    f"| {result['tokens_per_s']:.0f} tok/s | {result['model_tflops_per_s_per_device']:.1f} TFLOP/s | MFU {mfu} "
    f"| peak {peak_gb:.1f} GiB | compile + 2 steps {result['warmup_s']:.0f} s |"
  )


if __name__ == "__main__":
  run_absl(main, flags_parser=config_flags_parser)
