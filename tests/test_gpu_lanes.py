"""benchmarks/gpus.sh, sourced by the seed scripts: which GPU each lane (process) runs on."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lanes(tmp_path, lanes: int, **settings) -> subprocess.CompletedProcess:
  # An nvidia-smi that lists no GPU, also on a machine with GPUs: the settings alone decide.
  (tmp_path / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 9\n")
  (tmp_path / "nvidia-smi").chmod(0o755)
  env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "CUDA_VISIBLE_DEVICES")}
  env.update(PATH=f"{tmp_path}:{os.environ['PATH']}", **settings)
  script = f'source benchmarks/gpus.sh; echo "$GPUS"; for i in $(seq 0 {lanes - 1}); do gpu_of $i; done'
  return subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
  "settings, expected",
  [
    ({}, ["1", "0", "0", "0"]),  # no GPU listed: one lane
    ({"GPUS": "2"}, ["2", "0", "1", "0"]),
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, ["2", "2", "3", "2"]),  # started on some GPUs: stays on them
    ({"CUDA_VISIBLE_DEVICES": "5"}, ["1", "5", "5", "5"]),
    ({"CUDA_VISIBLE_DEVICES": "2,3", "GPUS": "1"}, ["1", "2", "2", "2"]),  # fewer lanes than GPUs
  ],
)
def test_each_lane_gets_a_visible_gpu_in_turn(tmp_path, settings, expected):
  done = _lanes(tmp_path, 3, **settings)
  assert done.returncode == 0, done.stderr
  assert done.stdout.split() == expected


@pytest.mark.parametrize("gpus", ["0", "two", "-1"])
def test_a_gpus_that_is_not_a_count_is_one_line(tmp_path, gpus):
  done = _lanes(tmp_path, 1, GPUS=gpus)
  assert done.returncode == 2 and done.stderr.strip() == f"ERROR: GPUS={gpus}: pass a number of GPUs >= 1"
