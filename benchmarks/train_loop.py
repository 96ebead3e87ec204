"""The real training loop against its own train step on synthetic tokens, same config, one process.

    python -m benchmarks.train_loop --config=configs/baseline_s.py --steps=30 \
        [--config.data.batch_size=16 --config.train.grad_accum_steps=1] [--json=out.json]

1. Synthetic: the jitted, sharded train step alone on random device-resident tokens
   (`synthetic_step.measure`, median of `--steps` steps), with ids drawn uniformly from
   the vocabulary.
2. The same step on real batches of the corpus, already on the device: the step's own
   speed on the data the real loop sees (the token distribution changes the cost of the
   embedding gradient's scatter-add, see RESULTS.md).
3. Real: `python -m train`'s `train()` on the embedded corpus in a fresh workdir for
   `--warmup_steps + --steps` steps, logging every `--log_every` steps; its tokens/s is
   read back from metrics.jsonl over the windows after the warm-up (each window's
   wall time includes the input pipeline, the host-to-device copy, the metrics fetch
   and printing: everything a user waits for, except eval and checkpoints, which are
   pushed past the end of the run).
4. Input pipeline alone: batches per second of the same grain iterator on this host.

Prints a table last: tokens/s of each and the real loop's ratio to both synthetic steps.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from absl import flags, logging
from ml_collections import config_flags

from castle_jax.command_line import run_absl
from train.command_line import config_flags_parser


from benchmarks.synthetic_step import measure  # noqa: E402

from castle_jax.data.pipeline import make_lm_iterator  # noqa: E402
from castle_jax.data.tokenizer import load_tokenizer  # noqa: E402
from train.metrics import read_metrics  # noqa: E402
from train.trainer import train  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.", lock_config=True)
_STEPS = flags.DEFINE_integer("steps", 30, "Measured steps of each loop (after the warm-up).", lower_bound=1)
_WARMUP = flags.DEFINE_integer(
  "warmup_steps", 10, "Real-loop steps before measuring (compilation, first log).", lower_bound=0
)
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Real-loop log interval (each log fetches metrics).", lower_bound=1)
_PIPELINE_BATCHES = flags.DEFINE_integer(
  "pipeline_batches", 20, "Batches timed for the input pipeline alone.", lower_bound=1
)
_JSON = flags.DEFINE_string("json", None, "Write the results here as JSON (a new file).")
flags.register_validator("json", lambda path: path is None or not os.path.lexists(path), "exists: pass a new file name")


def read_input_pipeline(config, batches: int) -> tuple[list[dict], float]:
  """(the first 3 batches, tokens/s of the training iterator alone after its first batch)."""
  tokenizer = load_tokenizer(config.data.tokenizer)
  iterator = make_lm_iterator(config.data, tokenizer, split=config.data.train_split, shuffle=True)
  first = [next(iterator) for _ in range(3)]
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  return first, batches * config.data.batch_size * config.data.seq_len / (time.perf_counter() - start)


def real_loop(config, warmup: int, steps: int, log_every: int) -> dict:
  """Runs train() in a temporary workdir and returns the steady-state throughput."""
  total = warmup + steps
  with tempfile.TemporaryDirectory() as workdir, config.unlocked():
    config.workdir = workdir
    t = config.train
    t.steps = total
    t.warmup_steps = min(t.warmup_steps, total)  # the schedule's shape does not change the speed
    t.log_every = log_every
    t.eval_every = total + 1  # eval and checkpoint only at the last step
    t.eval_batches = 1
    t.checkpoint_every = total + 1
    t.progress_bar = False
    start = time.perf_counter()
    train(config)
    wall_s = time.perf_counter() - start
    records = read_metrics(os.path.join(workdir, "metrics.jsonl"), "train")
  measured = [r for step, r in records.items() if step > warmup and step % log_every == 0 and step < total]
  if not measured:
    raise ValueError(f"no log window after step {warmup}: raise --steps or lower --log_every")
  rates = [r["tokens_per_sec"] for r in measured]
  result = {
    "tokens_per_s_median": statistics.median(rates),
    "tokens_per_s_windows": rates,
    "wall_s": wall_s,
    "final_loss": records[max(records)]["loss"],
  }
  waits = [r["data_wait_s"] for r in measured if "data_wait_s" in r]
  if waits:
    result["data_wait_s_median"] = statistics.median(waits)
  return result


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # as `python -m train` does
  config = _CONFIG.value
  real_batches, pipeline = read_input_pipeline(config, _PIPELINE_BATCHES.value)
  synthetic = measure(config, _STEPS.value)
  on_real_batches = measure(config, _STEPS.value, host_batches=real_batches)
  real = real_loop(config, _WARMUP.value, _STEPS.value, _LOG_EVERY.value)
  ratio = real["tokens_per_s_median"] / synthetic["tokens_per_s"]
  ratio_same_data = real["tokens_per_s_median"] / on_real_batches["tokens_per_s"]
  result = {
    "synthetic": synthetic,
    "synthetic_on_real_batches": on_real_batches,
    "real": real,
    "input_pipeline_tokens_per_s": pipeline,
    "real_over_synthetic": ratio,
    "real_over_synthetic_on_real_batches": ratio_same_data,
    "config": {
      "attention": config.model.attention,
      "batch": config.data.batch_size,
      "seq_len": config.data.seq_len,
      "grad_accum_steps": config.train.grad_accum_steps,
      "worker_count": config.data.worker_count,
    },
  }
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(result, f, indent=2)
  mfu = synthetic["mfu"]
  wait = real.get("data_wait_s_median")
  print(
    f"| {synthetic['device']} | {config.model.attention} | batch {config.data.batch_size} "
    f"(accum {config.train.grad_accum_steps}) x {config.data.seq_len} "
    f"| synthetic {synthetic['tokens_per_s']:.0f} tok/s ({synthetic['step_s_median'] * 1e3:.0f} ms/step"
    + (f", MFU {mfu:.1%}" if mfu is not None else "")
    + ") "
    f"| same step on real batches {on_real_batches['tokens_per_s']:.0f} tok/s "
    f"| real loop {real['tokens_per_s_median']:.0f} tok/s | real/synthetic {ratio:.3f} "
    f"| real/same-data step {ratio_same_data:.3f} "
    + (f"| data wait {wait * 1e3:.1f} ms/step " if wait is not None else "")
    + f"| input pipeline alone {pipeline / 1e6:.2f}M tok/s |"
  )


if __name__ == "__main__":
  run_absl(main, flags_parser=config_flags_parser)
