"""Metrics: a throughput window, the console/JSONL/TensorBoard sinks."""

from __future__ import annotations

import json
import os
import time
from typing import Mapping, Sequence

import jax


METRICS_NAME = "metrics.jsonl"
# Records of steps a resumed run logs again, moved out of metrics.jsonl (nothing is deleted).
SET_ASIDE_NAME = "metrics_set_aside.jsonl"


def _set_aside_records_from(path: str, first_step: int) -> int:
  """Moves the records of steps >= first_step from `path` to SET_ASIDE_NAME beside it
  (`path` is rewritten atomically); returns how many there were."""
  if not os.path.isfile(path):
    return 0
  with open(path) as f:
    lines = [line if line.endswith("\n") else line + "\n" for line in f if line.strip()]
  later = [line for line in lines if json.loads(line)["step"] >= first_step]
  if later:
    with open(os.path.join(os.path.dirname(path), SET_ASIDE_NAME), "a") as f:
      f.writelines(later)
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
      f.writelines(line for line in lines if json.loads(line)["step"] < first_step)
    os.replace(temporary, path)
  return len(later)


class MetricsWriter:
  """Writes scalar metrics from process 0; other processes write nothing.

  Files: `<workdir>/metrics.jsonl` (one JSON object per line with "step", "split"
  and the scalars, line-buffered) and TensorBoard events under
  `<workdir>/tensorboard/`, written and flushed at every `write` so a killed run
  loses nothing that was logged. The events go through tensorboardX's synchronous
  `EventsWriter`: `SummaryWriter` hands them to a background thread, and its flush()
  does not wait for that thread, so an event could still be in memory after it.
  `close()` (always call it, e.g. in a `finally`) closes the files.

  `first_step`: the first step this run logs (the resumed step + 1; 0 for a fresh run). The
  records of that step and later ones already in metrics.jsonl (written by a run that got
  further than its last checkpoint, or by one that saved none) are moved to
  metrics_set_aside.jsonl, since this run logs those steps again; TensorBoard gets its
  "restart at this step" marker, which hides the older events of those steps.
  """

  def __init__(self, workdir: str, *, first_step: int = 0, tensorboard: bool = True):
    self.enabled = jax.process_index() == 0
    self._tb = None
    self._jsonl = None
    self.set_aside = 0  # records of steps >= first_step moved out of metrics.jsonl
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, METRICS_NAME)
    self.set_aside = _set_aside_records_from(path, first_step)
    self._jsonl = open(path, "a", buffering=1)
    if tensorboard:
      # imported here: only process 0 writes events
      from tensorboardX.event_file_writer import EventsWriter
      from tensorboardX.proto.event_pb2 import Event, SessionLog

      directory = os.path.join(workdir, "tensorboard")
      os.makedirs(directory, exist_ok=True)
      self._tb = EventsWriter(os.path.join(directory, "events"))
      if self.set_aside or first_step > 0:
        self._tb.write_event(Event(step=first_step, session_log=SessionLog(status=SessionLog.START)))
        self._tb.flush()

  def write(self, step: int, split: str, scalars: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), "split": split, "time": time.time(), **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    if self._tb is not None:
      from tensorboardX.proto.event_pb2 import Event
      from tensorboardX.summary import scalar

      for key, value in scalars.items():
        self._tb.write_event(
          Event(wall_time=record["time"], step=int(step), summary=scalar(f"{split}/{key}", float(value)))
        )
      self._tb.flush()

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None


class ThroughputWindow:
  """Tokens/s, MFU and input wait over the steps since the last log.

  `add(tokens, data_wait_s)` per step (once its metrics are on the host);
  `pause()`/`resume()` around work that is not training (eval); `summary()`
  then `reset()` at each log step.
  """

  def __init__(self, flops_per_token: float, peak_flops: float | None, device_count: int):
    self._flops_per_token = flops_per_token
    self._peak_total = peak_flops * device_count if peak_flops else None
    self.reset()

  def reset(self) -> None:
    self._start = time.perf_counter()
    self._paused = 0.0
    self._tokens = 0.0
    self._data_wait = 0.0
    self._steps = 0

  def add(self, tokens: float, data_wait_s: float) -> None:
    self._tokens += tokens
    self._data_wait += data_wait_s
    self._steps += 1

  def exclude(self, seconds: float) -> None:
    """Takes `seconds` (eval, checkpoint waits) out of the window's elapsed time."""
    self._paused += seconds

  def summary(self) -> dict[str, float]:
    elapsed = max(time.perf_counter() - self._start - self._paused, 1e-9)
    out = {"tokens_per_sec": self._tokens / elapsed, "data_wait_s": self._data_wait / max(self._steps, 1)}
    if self._peak_total is not None:
      out["mfu"] = out["tokens_per_sec"] * self._flops_per_token / self._peak_total
    return out


def format_train_line(step: int, record: Mapping[str, float]) -> str:
  return (
    f"step {step:6d} | loss {record['loss']:.4f} | grad_norm {record['grad_norm']:.3f} | "
    f"lr {record['learning_rate']:.2e} | {record['tokens_per_sec']:.0f} tok/s"
    + (f" | MFU {record['mfu']:.1%}" if "mfu" in record else "")
    + f" | data wait {record['data_wait_s'] * 1e3:.1f} ms/step"
  )


def format_eval_line(step: int, record: Mapping[str, float]) -> str:
  return (
    f"step {step:6d} | eval loss {record['loss']:.4f} | ppl {record['perplexity']:.2f} | "
    f"{record['bits_per_byte']:.4f} bits/byte"
  )


def _over_seeds(records: Sequence[Mapping[str, float]], key: str, digits: int = 4) -> str:
  """'mean (min..max, N seeds)' of `key` over the seeds' records."""
  values = [record[key] for record in records]
  mean = sum(values) / len(values)
  return f"{mean:.{digits}f} ({min(values):.{digits}f}..{max(values):.{digits}f}, {len(values)} seeds)"


def format_seeds_train_line(step: int, records: Sequence[Mapping[str, float]], throughput: Mapping[str, float]) -> str:
  """One line for the seeds of a vmapped run; `throughput`: all seeds together."""
  grad_norm = sum(record["grad_norm"] for record in records) / len(records)
  return (
    f"step {step:6d} | loss {_over_seeds(records, 'loss')} | grad_norm {grad_norm:.3f} | "
    f"lr {records[0]['learning_rate']:.2e} | {throughput['tokens_per_sec']:.0f} tok/s"
    + (f" | MFU {throughput['mfu']:.1%}" if "mfu" in throughput else "")
    + f" | data wait {throughput['data_wait_s'] * 1e3:.1f} ms/step"
  )


def format_seeds_eval_line(step: int, records: Sequence[Mapping[str, float]]) -> str:
  return (
    f"step {step:6d} | eval loss {_over_seeds(records, 'loss')} | {_over_seeds(records, 'bits_per_byte')} bits/byte"
  )


def read_metrics(path: str, split: str = "train") -> dict[int, dict]:
  """Loads metrics.jsonl as {step: record} of `split` (a resumed run writes each step once:
  `MetricsWriter(first_step=...)`)."""
  by_step = {}
  with open(path) as f:
    for line in f:
      record = json.loads(line)
      if record["split"] == split:
        by_step[record["step"]] = record
  return dict(sorted(by_step.items()))
