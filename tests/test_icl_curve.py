"""`python -m benchmarks.icl_curve`: per-seed loss-by-position curves of tiny arms trained on CPU,
checked against each model's own losses and hand-computed statistics; a SIGTERM writes what was
evaluated; bad input is one error line."""

import csv
import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import optax
import pytest

from benchmarks import icl_curve
from castle_jax.command_line import UsageError
from castle_jax.data.pipeline import get_data_source
from castle_jax.workdir import load_trained_model
from configs import tiny, tiny_power
from helpers import tiny_run
from train.trainer import train

# Its module-scoped fixtures are costly (trained models, compiled steps): one worker runs the
# whole module under `--dist loadgroup`, so they are built once.
pytestmark = pytest.mark.xdist_group("test_icl_curve")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# t quantile 0.975 with 1 degree of freedom (statistical tables): the interval of 2 seeds.
T_975_1 = 12.706204736174707
SEQ_LEN = 32  # helpers.TINY_RUN_SETTINGS
DOCS = 3


@pytest.fixture(scope="module")
def arms(tmp_path_factory, stdlib_data_dir):
  """Workdirs: `mha` (2 vmapped seeds, checkpoints at steps 2 and 4), `power` (2 seeds,
  checkpoint 2), `late` (2 seeds, checkpoint 3 only) and `single` (one run)."""
  root = tmp_path_factory.mktemp("icl_arms")
  runs = {
    "mha": (tiny, {"train.steps": 4, "train.checkpoint_every": 2, "train.seeds": 2}),
    "power": (tiny_power, {"train.steps": 2, "train.checkpoint_every": 2, "train.seeds": 2}),
    "late": (tiny, {"train.steps": 3, "train.checkpoint_every": 3, "train.seeds": 2}),
    "single": (tiny, {"train.steps": 2, "train.checkpoint_every": 2}),
  }
  paths = {}
  for name, (module, settings) in runs.items():
    config = tiny_run(module, str(root / name), stdlib_data_dir, **{"train.warmup_steps": 1, **settings})
    train(config)
    paths[name] = config.workdir
  paths["data_dir"] = stdlib_data_dir
  return paths


def _main(*argv):
  """Runs the command in this process with `argv` as its flags."""
  icl_curve.FLAGS.unparse_flags()
  icl_curve.FLAGS(["icl_curve", *argv])
  try:
    icl_curve.main([])
  finally:
    icl_curve.FLAGS.unparse_flags()


def _own_losses(workdir, step, data_dir):
  """float64 [SEQ_LEN]: the model's mean NLL per position over the first DOCS validation documents
  with SEQ_LEN + 1 byte tokens, computed here from the corpus and the model's logits."""
  model, params, tokenizer, _ = load_trained_model(workdir, step)
  source = get_data_source("python_stdlib", "validation", data_dir)
  rows = []
  for index in range(len(source)):
    text = source[index]["text"]
    tokens = [tokenizer.bos_id, *(text if isinstance(text, bytes) else text.encode("utf-8"))]
    if len(tokens) > SEQ_LEN:
      rows.append(tokens[: SEQ_LEN + 1])
    if len(rows) == DOCS:
      break
  tokens = np.asarray(rows, np.int32)
  logits, _ = model.apply({"params": params}, tokens[:, :-1])
  nll = optax.softmax_cross_entropy_with_integer_labels(np.asarray(logits, np.float64), tokens[:, 1:])
  return np.asarray(nll).mean(0)


def _interval(values):
  mean = sum(values) / len(values)
  sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
  half = T_975_1 * sd / math.sqrt(len(values))
  return mean, mean - half, mean + half


def test_seed_curves_match_the_models_and_hand_computed_intervals(arms, tmp_path, capsys):
  output = str(tmp_path / "curve")
  _main(f"--workdirs={arms['mha']},{arms['power']}", "--step=common", f"--max_docs={DOCS}", f"--output={output}")
  result = json.load(open(output + ".json"))
  assert result["complete"] and result["documents"] == DOCS and result["seq_len"] == SEQ_LEN
  assert result["early"] == [2, 4] and result["late"] == [16, 32]  # [L/16, L/8) and [L/2, L)
  assert list(result["runs"]) == ["mha/seed_0", "power/seed_0", "mha/seed_1", "power/seed_1"]
  assert {run["step"] for run in result["runs"].values()} == {2}  # the only step both arms hold
  for name, run in result["runs"].items():
    own = _own_losses(run["workdir"], 2, arms["data_dir"])
    np.testing.assert_allclose(run["loss"], own, atol=2e-5, err_msg=name)
    assert run["late_minus_early"] == pytest.approx(own[16:32].mean() - own[2:4].mean(), abs=1e-4)
  bins = result["bins"]
  assert bins[0] == [0, 1] and bins[-1][1] == SEQ_LEN
  assert all(a < b for a, b in bins) and all(b == c for (_, b), (c, _) in zip(bins, bins[1:]))
  for arm in ("mha", "power"):
    seeds = [result["runs"][f"{arm}/seed_{k}"] for k in range(2)]
    statistics = result["arms"][arm]
    assert statistics["seeds"] == [0, 1] and statistics["steps"] == [2]
    for i, (a, b) in enumerate(bins):
      mean, low, high = _interval([float(np.mean(run["loss"][a:b])) for run in seeds])
      assert statistics["binned"]["mean"][i] == pytest.approx(mean, abs=1e-5)
      assert statistics["binned"]["low"][i] == pytest.approx(low, abs=1e-4)
      assert statistics["binned"]["high"][i] == pytest.approx(high, abs=1e-4)
    mean, low, high = _interval([run["late_minus_early"] for run in seeds])
    gain = statistics["late_minus_early"]
    assert (gain["mean"], gain["low"], gain["high"]) == pytest.approx((mean, low, high), rel=1e-9)
  # The gain's difference to the first arm, paired by seed.
  differences = [
    result["runs"][f"power/seed_{k}"]["late_minus_early"] - result["runs"][f"mha/seed_{k}"]["late_minus_early"]
    for k in range(2)
  ]
  versus = result["arms"]["power"]["gain_vs_first"]
  assert versus["base"] == "mha" and versus["seeds"] == [0, 1]
  assert (versus["mean"], versus["low"], versus["high"]) == pytest.approx(_interval(differences), rel=1e-9)
  assert "gain_vs_first" not in result["arms"]["mha"]
  with open(output + ".csv") as f:
    rows = list(csv.reader(f))
  assert rows[0] == ["bin_start", "bin_stop", "mha", "mha_low", "mha_high", "power", "power_low", "power_high"]
  assert len(rows) == len(bins) + 1
  assert float(rows[1][5]) == pytest.approx(result["arms"]["power"]["binned"]["mean"][0], abs=1e-5)
  assert os.path.getsize(output + ".png") > 0
  out = capsys.readouterr().out
  assert "late - early: mean loss (nats/token) over positions [16, 32) minus over [2, 4)" in out
  # Re-summarized from the JSON alone, the statistics are the same.
  again = str(tmp_path / "again")
  _main(f"--from_json={output}.json", f"--output={again}")
  assert json.load(open(again + ".json"))["arms"] == result["arms"]


def test_statistics_of_synthetic_runs_equal_hand_computed_values():
  """Two arms of two seeds with losses 3 - slope * position / 8 over 8 positions."""
  slopes = {("a", 0): 0.0, ("a", 1): 0.2, ("b", 0): 1.0, ("b", 1): 1.6}
  runs = {
    f"{arm}/seed_{seed}": {"arm": arm, "seed": seed, "step": 5, "loss": [3 - slope * t / 8 for t in range(8)]}
    for (arm, seed), slope in slopes.items()
  }
  result = icl_curve.summarize(
    {"bins": icl_curve.log_bins(8, 1), "early": [1, 2], "late": [4, 8], "documents": 2, "seq_len": 8, "runs": runs}
  )
  assert [list(b) for b in result["bins"]] == [[0, 1], [1, 2], [2, 4], [4, 8]]
  # Early: position 1; late: positions 4..7, whose mean is 5.5.
  gains = {key: -slope * (5.5 - 1) / 8 for key, slope in slopes.items()}
  for key, gain in gains.items():
    assert runs[f"{key[0]}/seed_{key[1]}"]["late_minus_early"] == pytest.approx(gain, rel=1e-12)
  a = result["arms"]["a"]["late_minus_early"]
  assert (a["mean"], a["low"], a["high"]) == pytest.approx(_interval([gains["a", 0], gains["a", 1]]), rel=1e-12)
  versus = result["arms"]["b"]["gain_vs_first"]
  expected = _interval([gains["b", 0] - gains["a", 0], gains["b", 1] - gains["a", 1]])
  assert (versus["mean"], versus["low"], versus["high"]) == pytest.approx(expected, rel=1e-12)
  # t = mean / (sd / sqrt(2)) with sd of (-0.5625, -0.7875): 1 degree of freedom.
  mean, sd = -0.675, 0.1125 * math.sqrt(2)
  t = mean / (sd / math.sqrt(2))
  assert versus["t"] == pytest.approx(t, rel=1e-9)
  assert versus["p"] == pytest.approx(1 - 2 / math.pi * math.atan(abs(t)), rel=1e-9)  # Cauchy's tails
  table = icl_curve.format_table(result)
  assert "b" in table and "t = -6.00" in table


def test_a_sigterm_writes_the_runs_already_evaluated(arms, tmp_path, monkeypatch, capsys):
  original = icl_curve.per_position_loss
  calls = []

  def interrupted_after_the_first(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return original(*args, **kwargs)

  monkeypatch.setattr(icl_curve, "per_position_loss", interrupted_after_the_first)
  handler = signal.getsignal(signal.SIGTERM)
  output = str(tmp_path / "partial")
  _main(f"--workdirs={arms['mha']},{arms['power']}", "--step=2", f"--max_docs={DOCS}", f"--output={output}")
  result = json.load(open(output + ".json"))
  assert not result["complete"] and list(result["runs"]) == ["mha/seed_0"]
  assert (
    result["arms"]["mha"]["late_minus_early"]["n"] == 1 and result["arms"]["mha"]["late_minus_early"]["low"] is None
  )
  assert "stopped by SIGTERM: writing the 1 of 4 runs evaluated" in capsys.readouterr().out
  assert signal.getsignal(signal.SIGTERM) == handler


@pytest.mark.parametrize(
  "argv, expected",
  [
    (["--workdirs={mha},{single}"], "--workdirs: {single} holds a single run but {mha} a run of several seeds"),
    (["--workdirs={mha}", "--late=0,99"], "--late=0,99: positions must satisfy 0 <= START < STOP <= seq_len (32)"),
    (["--workdirs={mha}", "--early=8,8"], "--early=8,8: positions must satisfy 0 <= START < STOP"),
    (["--workdirs={mha}", "--early=8"], "--early=8: expected two integers START,STOP"),
    (
      ["--workdirs={mha}", "--step=3"],
      "--step=3: mha/seed_0 ({mha}/seed_0) has no checkpoint of step 3; it has [2, 4]",
    ),
    (["--workdirs={mha}", "--step=last"], "--step=last: expected a checkpoint step (an integer) or 'common'"),
    (["--workdirs={mha},{late}", "--step=common"], "--step=common: no checkpoint step is held by every run"),
    (["--workdirs={mha},{empty}"], "--workdirs: {empty} is neither a training run (config.json) nor a run of several"),
    (["--workdirs={mha},{nowhere}"], "--workdirs: {nowhere}: no such directory"),
    (["--workdirs={mha},{mha}"], "--workdirs: two arms are named 'mha'"),
    (["--workdirs={unseeded}"], "--workdirs: {unseeded}/seed_0 has no config.json: seed not trained"),
    (["--workdirs={mha}", "--from_json={mha}/seeds.json"], "--from_json and --workdirs exclude each other"),
    (["--from_json={mha}/seeds.json"], "--from_json={mha}/seeds.json: not a result file of this command"),
  ],
)
def test_bad_input_is_a_usage_error_naming_it(arms, tmp_path, argv, expected):
  paths = {**arms, "empty": str(tmp_path / "empty"), "nowhere": str(tmp_path / "nowhere")}
  paths["unseeded"] = str(tmp_path / "unseeded")
  os.makedirs(paths["empty"])
  os.makedirs(paths["unseeded"])
  with open(os.path.join(paths["unseeded"], "seeds.json"), "w") as f:
    json.dump({"seeds": 2, "seeds_mode": "vmap"}, f)
  with pytest.raises(UsageError) as raised:
    _main(*(a.format(**paths) for a in argv), f"--output={tmp_path / 'out'}")
  assert expected.format(**paths) in str(raised.value)
  assert not os.path.exists(tmp_path / "out.json")


def test_the_command_ends_bad_input_in_one_error_line(arms, tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  command = [sys.executable, "-m", "benchmarks.icl_curve", f"--workdirs={arms['mha']},{arms['single']}"]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  lines = [line for line in done.stderr.splitlines() if line.strip()]
  assert done.returncode == 1 and len(lines) == 1, done.stderr
  assert lines[0].startswith("ERROR: --workdirs:") and "holds a single run" in lines[0]
