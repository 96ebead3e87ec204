"""Metrics sinks: stdout, a JSONL file and TensorBoard event files."""

from __future__ import annotations

import json
import os
import time
from typing import Mapping

import jax


class MetricsWriter:
  """Writes scalar metrics from process 0; other processes write nothing.

  Files: `<workdir>/metrics.jsonl` (one JSON object per line with "step", "split"
  and the scalars) and TensorBoard events under `<workdir>/tensorboard/`.
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    self.enabled = jax.process_index() == 0
    self._tb = None
    self._jsonl = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)
    if tensorboard:
      from tensorboardX import SummaryWriter  # imported here: only process 0 writes events
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

  def write(self, step: int, split: str, scalars: Mapping[str, float]) -> None:
    if not self.enabled:
      return
    record = {"step": int(step), "split": split, "time": time.time(), **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for key, value in scalars.items():
        self._tb.add_scalar(f"{split}/{key}", float(value), int(step))

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(path: str, split: str = "train") -> dict[int, dict]:
  """Loads metrics.jsonl; for a step logged twice (a resumed run) the last record wins."""
  by_step = {}
  with open(path) as f:
    for line in f:
      record = json.loads(line)
      if record["split"] == split:
        by_step[record["step"]] = record
  return dict(sorted(by_step.items()))
