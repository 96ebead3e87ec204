"""benchmarks/drt_seeds.sh: the passkey seeds of the tiny DRT recipe, stage 1 then both retrievers'
stage 2 from it and the evaluations, with the seeds spread over processes when several GPUs are
given (on a CPU the processes share it); bad settings are one line each."""

import json
import os

import pytest

from helpers import run_seed_script


def _run(tmp_path, **settings):
  return run_seed_script("drt_seeds.sh", tmp_path, **settings)


@pytest.mark.parametrize(
  "settings, message",
  [
    ({"GPUS": "0"}, "ERROR: GPUS=0: pass a number of GPUs >= 1"),
    ({"GPUS": "two"}, "ERROR: GPUS=two: pass a number of GPUs >= 1"),
    ({"SEEDS": "0"}, "ERROR: SEEDS=0: pass a number of seeds >= 1"),
    ({"STAGES": "1 3"}, "ERROR: STAGES: unknown part '3' (choose among 1 2 eval)"),
  ],
)
def test_bad_settings_are_one_line_before_anything_runs(tmp_path, settings, message):
  done = _run(tmp_path, timeout=60, SMOKE="1", **settings)
  assert done.returncode == 2 and done.stderr.strip() == message, done.stderr
  assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # about 90 s on 2 CPU cores: 2 + 4 training and 4 evaluation processes
def test_two_gpus_train_each_seed_in_its_own_process_into_one_run(tmp_path):
  done = _run(tmp_path, SMOKE="1", GPUS="2")
  out, runs = tmp_path / "out", tmp_path / "runs"
  timeline = (out / "timeline.txt").read_text()
  assert done.returncode == 0, timeline + done.stderr
  assert "2 seeds on 2 GPU(s)" in timeline
  logs = sorted(os.listdir(out / "logs"))
  assert [name for name in logs if name.startswith("stage")] == [
    "stage1_gpu0.log",
    "stage1_gpu1.log",
    "stage2_learned_seed0.log",
    "stage2_learned_seed1.log",
    "stage2_random_seed0.log",
    "stage2_random_seed1.log",
  ]
  for stage in ("stage1", "stage2_learned", "stage2_random"):
    assert json.loads((runs / stage / "seeds.json").read_text())["seeds"] == 2
    for k in range(2):
      config = json.loads((runs / stage / f"seed_{k}" / "config.json").read_text())
      assert config["seed"] == k
      if stage != "stage1":
        assert config["train"]["init_from"] == str(runs / "stage1" / f"seed_{k}")
  summary = json.loads((out / "summary.json").read_text())
  assert summary["arms"]["learned"]["seeds_evaluated"] == {"1024": 2}
  assert "random_minus_learned" in summary
