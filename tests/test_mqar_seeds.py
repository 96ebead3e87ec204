"""benchmarks/mqar_seeds.sh trains its stages in order, each later stage of an arm from
the previous stage's seeds (seed k from seed k), scores and compares the arms at the last
stage's pairs; bad settings and training failures are said plainly."""

import glob
import json

import pytest

from helpers import run_seed_script


def _run(tmp_path, **settings):
  return run_seed_script("mqar_seeds.sh", tmp_path, **settings)


@pytest.mark.slow  # about 3 minutes on one CPU core: 8 training and 8 scoring processes
def test_smoke_run_trains_stage_two_from_stage_one_and_compares_at_its_pairs(tmp_path):
  done = _run(tmp_path, SMOKE="1", ARMS="p2 mha castle p2_norm", D_MODEL="32")  # wider than its 2 heads of 8
  out, runs = tmp_path / "out", tmp_path / "runs"
  summary = (out / "summary.txt").read_text()
  assert done.returncode == 0, summary + done.stderr
  for arm in ("p2", "mha"):
    assert f"train {arm} stage1_pairs2 (4 steps, at most" in summary
    assert f"train {arm} stage2_pairs4 (4 steps, from stage1_pairs2, at most" in summary
    for k in range(2):
      config = json.loads((out / "stages" / arm / "stage2_pairs4" / f"seed_{k}" / "config.json").read_text())
      assert config["train"]["init_from"] == str(runs / arm / "stage1_pairs2" / f"seed_{k}")
      mqar = config["data"]["mqar"]
      assert (mqar["pairs"], mqar["queries"], config["data"]["seq_len"]) == (4, 4, 16)
      model = config["model"]
      assert (model["d_model"], model["n_heads"], model["head_dim"]) == (32, 2, 8)
      first = json.loads((out / "stages" / arm / "stage1_pairs2" / f"seed_{k}" / "config.json").read_text())
      assert not first["train"].get("init_from") and first["data"]["mqar"]["pairs"] == 2
      with open(out / arm / f"seed_{k}" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
      assert [r["source_step"] for r in records if r["split"] == "init_from"] == [4]
      (scored,) = glob.glob(str(out / arm / f"seed_{k}" / "eval" / "tasks_mqar_step4*.json"))
      with open(scored) as f:
        assert json.load(f)["knobs"]["pairs"] == 4
  for k in range(2):
    castle = json.loads((out / "stages" / "castle" / "stage2_pairs4" / f"seed_{k}" / "config.json").read_text())
    assert (castle["model"]["attention"], castle["model"]["n_heads"]) == ("castle", 1)  # parameter parity
    normed = json.loads((out / "stages" / "p2_norm" / "stage2_pairs4" / f"seed_{k}" / "config.json").read_text())
    assert normed["model"]["attention_kwargs"] == {"p": 2, "output_norm": "layernorm"}
  for folder in ("compare_query_accuracy", "compare_answer_loss", "compare_first_query"):
    assert (out / folder).is_dir(), folder
  assert "ARM " not in summary
  again = _run(tmp_path, SMOKE="1")
  assert again.returncode == 2 and "holds the results of an earlier run" in again.stderr


@pytest.mark.parametrize(
  "settings, message",
  [
    (dict(STEPS="3000"), "STEPS is no longer read: the pairs come in stages"),
    (dict(PAIRS="32"), "PAIRS is no longer read"),
    (dict(STAGES="4 8", STAGE_STEPS="10 20 30"), "STAGE_STEPS='10 20 30' gives 3 step counts for 2 stages"),
    (dict(STAGES="4 x"), "STAGES='4 x': 'x' is not a positive number of pairs"),
    (dict(STAGES="4 32", KEY_VOCAB="26"), "KEY_VOCAB='26' must be a number of keys at least the largest stage's 32"),
    (dict(LAYOUT="spaced"), "LAYOUT must be colon or compact"),
    (dict(STAGE_START="soon"), "STAGE_START='soon' is not a number of seconds"),
    (dict(D_MODEL="wide"), "N_HEADS, HEAD_DIM and D_MODEL must be positive numbers, got '2', '8', 'wide'"),
    (dict(ARMS="p2 gca"), "ARMS: unknown arm 'gca'; choose from p2 p4 p2_norm p4_norm mha castle castle_swl"),
    (dict(ARMS="mha castle_swl", N_HEADS="3"), "N_HEADS=3 is odd: the castle arms take half of it"),
    (dict(GPUS="0"), "GPUS=0: pass a number of GPUs >= 1"),
  ],
)
def test_bad_settings_are_one_error_line_before_anything_runs(tmp_path, settings, message):
  done = _run(tmp_path, python="false", SMOKE="1", **settings)
  assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
  assert not (tmp_path / "out").exists()


def test_an_arm_whose_first_stage_fails_runs_no_later_stage_and_is_named(tmp_path):
  """A Python that fails every command: each arm stops at its first stage, and the summary
  ends with why, arm by arm; the exit status says the run failed."""
  fake = tmp_path / "python"
  fake.write_text("#!/usr/bin/env bash\necho 'no such model' >&2\nexit 3\n")
  fake.chmod(0o755)
  done = _run(tmp_path, python=str(fake), timeout=120, SMOKE="1", ARMS="p2 mha")
  summary = (tmp_path / "out" / "summary.txt").read_text()
  assert done.returncode == 1, summary
  for arm in ("p2", "mha"):
    why = f"training FAILED in stage1_pairs2 (exit status 3, logs/train_{arm}_stage1.log): no such model"
    assert f"ARM {arm}: {why}" in summary
    assert not (tmp_path / "out" / "logs" / f"train_{arm}_stage2.log").exists()


@pytest.mark.parametrize(
  "settings, expected",
  [
    ({"GPUS": "2", "CUDA_VISIBLE_DEVICES": ""}, ["0", "1", "0"]),
    ({"CUDA_VISIBLE_DEVICES": "4,6"}, ["4", "6", "4"]),  # started on some GPUs: stays on them
  ],
)
def test_arms_train_on_the_gpus_in_turn(tmp_path, settings, expected):
  """Arm i trains on the i-th GPU (mod GPUS): CUDA_VISIBLE_DEVICES of its processes."""
  fake = tmp_path / "python"
  fake.write_text('#!/usr/bin/env bash\necho "on GPU $CUDA_VISIBLE_DEVICES" >&2\nexit 3\n')
  fake.chmod(0o755)
  _run(tmp_path, python=str(fake), timeout=120, SMOKE="1", ARMS="p2 mha castle", **settings)
  logs = tmp_path / "out" / "logs"
  for arm, gpu in zip(("p2", "mha", "castle"), expected):
    assert (logs / f"train_{arm}_stage1.log").read_text().strip() == f"on GPU {gpu}", arm
