"""`python -m castle_jax.eval.compare`: statistics against hand-computed values on synthetic
arms, arms that cannot be compared named in one line, and two tiny arms trained on CPU."""

import json
import math
import os
import sys

import pytest

from castle_jax.eval import compare, perplexity
from configs import tiny
from helpers import tiny_run
from train.config import base_config
from train.trainer import train

# t quantile 0.975 with 3 degrees of freedom (statistical tables).
T_975_3 = 3.182446305284263
TOKENS_PER_STEP = 2 * 8  # data.batch_size x data.seq_len of the synthetic arms


def _write_arm(path, evaluations, *, seeds=None, mode="vmap", data=None, untrained=()):
  """A run of several seeds as the trainer writes it: seeds.json, and per seed a config.json
  and a metrics.jsonl whose eval records are `evaluations[k]` = [(step, loss, elapsed_s), ...]."""
  os.makedirs(path)
  count = seeds if seeds is not None else len(evaluations) + len(untrained)
  with open(os.path.join(path, "seeds.json"), "w") as f:
    json.dump({"seeds": count, "seeds_mode": mode}, f)
  for k, records in evaluations.items():
    seed_dir = os.path.join(path, f"seed_{k}")
    os.makedirs(seed_dir)
    config = base_config().to_dict()
    config.update(seed=k, workdir=seed_dir)
    config["data"].update({"batch_size": 2, "seq_len": 8, "shuffle_seed": k, **(data or {}).get(k, {})})
    config["train"]["seeds"] = None
    with open(os.path.join(seed_dir, "config.json"), "w") as f:
      json.dump(config, f)
    with open(os.path.join(seed_dir, "metrics.jsonl"), "w") as f:
      for step, loss, seconds in records:
        f.write(json.dumps({"step": step, "split": "train", "loss": loss + 0.1, "elapsed_s": seconds}) + "\n")
        record = {"step": step, "split": "eval", "loss": loss, "perplexity": math.exp(loss)}
        record.update(bits_per_byte=loss / math.log(2), **({"elapsed_s": seconds} if seconds is not None else {}))
        f.write(json.dumps(record) + "\n")
  return str(path)


def _write_eval(arm, seed, name, record):
  """An evaluation command's results file `name` in seed `seed`'s eval/ of `arm`."""
  directory = os.path.join(arm, f"seed_{seed}", "eval")
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, name), "w") as f:
    json.dump(record, f)


def _final(values, step=20, seconds=20.0):
  """One evaluation per seed at `step`, plus one at step 10."""
  return {k: [(10, v + 1.0, seconds / 2), (step, v, seconds)] for k, v in enumerate(values)}


def _run(capsys, *argv):
  status = compare.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return status, out, err


def _t_distribution_p_3(t):
  """Two-sided p of t with 3 degrees of freedom, from the closed form of its distribution."""
  x = abs(t) / math.sqrt(3)
  return 1 - 2 / math.pi * (x / (1 + x * x) + math.atan(x))


def test_interval_and_paired_test_equal_hand_computed_values(tmp_path, capsys, monkeypatch):
  a = _write_arm(tmp_path / "A", _final([1.0, 2.0, 3.0, 4.0]))
  b = _write_arm(tmp_path / "B", _final([1.5, 2.1, 3.4, 4.2]))
  os.makedirs(tmp_path / "cwd")
  monkeypatch.chdir(tmp_path / "cwd")
  status, out, err = _run(capsys, a, b)
  assert status == 0, err
  assert not os.listdir(tmp_path / "cwd")  # nothing written where the command ran
  record = json.load(open(tmp_path / "A" / "compare" / "compare_eval_loss.json"))
  assert record["paired"] and record["equal_tokens"]["tokens"] == 20 * TOKENS_PER_STEP
  assert record["equal_tokens"]["steps"] == {a: 20, b: 20}
  base, other = record["equal_tokens"]["arms"]
  assert base["values"] == {"0": 1.0, "1": 2.0, "2": 3.0, "3": 4.0}
  half = T_975_3 * math.sqrt(5 / 3) / 2
  assert (base["n"], base["mean"], base["sd"]) == (4, 2.5, pytest.approx(math.sqrt(5 / 3), rel=1e-12))
  assert (base["low"], base["high"]) == (pytest.approx(2.5 - half, rel=1e-12), pytest.approx(2.5 + half, rel=1e-12))
  difference = other["difference"]
  sd = math.sqrt(((0.5 - 0.3) ** 2 + (0.1 - 0.3) ** 2 + (0.4 - 0.3) ** 2 + (0.2 - 0.3) ** 2) / 3)
  t = 0.3 / (sd / 2)
  assert difference["seeds"] == [0, 1, 2, 3] and difference["mean"] == pytest.approx(0.3, rel=1e-12)
  assert difference["low"] == pytest.approx(0.3 - T_975_3 * sd / 2, rel=1e-12)
  assert difference["t"] == pytest.approx(t, rel=1e-12)
  assert difference["p"] == pytest.approx(_t_distribution_p_3(t), rel=1e-9)
  assert difference["wilcoxon_p"] is None  # 4 pairs: too few
  # Both arms ran at the same speed: at 20 s every seed is at its step-20 evaluation.
  assert record["equal_time"]["seconds"] == 20.0
  assert record["equal_time"]["arms"][1]["difference"]["t"] == pytest.approx(t, rel=1e-12)
  # What was written, then the tables, last.
  lines = out.strip().splitlines()
  assert lines[0] == f"wrote {tmp_path}/A/compare/compare_eval_loss.json and {tmp_path}/A/compare/compare_eval_loss.png"
  assert lines[1] == f"eval_loss at 320 training tokens ({a} step 20, {b} step 20); paired by seed index"
  assert lines[4].split()[:5] == [a, "4", "2.5000", f"[{2.5 - half:.4f},", f"{2.5 + half:.4f}]"]
  assert lines[5].split()[5:] == [
    "0.3000",
    f"[{0.3 - T_975_3 * sd / 2:.4f},",
    f"{0.3 + T_975_3 * sd / 2:.4f}]",
    f"{t:.2f}",
    f"{_t_distribution_p_3(t):.3g}",
    "-",
  ]
  assert "at 20.0 s of training after the first step (interpolated)" in out

  # A second comparison never replaces the first.
  assert _run(capsys, a, b, "--metric=bits_per_byte")[0] == 0
  assert _run(capsys, a, b)[0] == 0
  assert sorted(os.listdir(tmp_path / "A" / "compare")) == [
    "compare_bits_per_byte.json",
    "compare_bits_per_byte.png",
    "compare_eval_loss-2.json",
    "compare_eval_loss-2.png",
    "compare_eval_loss.json",
    "compare_eval_loss.png",
  ]


def test_wilcoxon_from_six_pairs_and_exact():
  base = {k: float(k) for k in range(6)}
  all_up = {k: k + 0.1 * (k + 1) for k in range(6)}  # six positive differences
  assert compare.paired_difference(base, all_up)["wilcoxon_p"] == pytest.approx(2 / 64)
  one_down = {**all_up, 0: -0.1}  # the smallest difference negative: rank sum 1
  assert compare.paired_difference(base, one_down)["wilcoxon_p"] == pytest.approx(4 / 64)
  assert compare.paired_difference(dict(list(base.items())[:5]), all_up)["wilcoxon_p"] is None


def test_unpaired_difference_is_welch():
  result = compare.unpaired_difference([1.0, 2.0, 3.0], [2.0, 4.0, 6.0, 8.0])
  va, vb = 1.0 / 3, (20 / 3) / 4  # sample variances over n
  degrees = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
  assert result["mean"] == 3.0 and result["degrees"] == pytest.approx(degrees, rel=1e-12)
  assert result["t"] == pytest.approx(3.0 / math.sqrt(va + vb), rel=1e-12)
  from scipy import stats

  assert result["p"] == pytest.approx(2 * stats.t.sf(result["t"], degrees), rel=1e-12)


def test_equal_time_counts_from_the_end_of_the_first_step(tmp_path, capsys):
  # Step 1 holds the compilation: 2 s in one arm, 12 s (a fresh compile) in the other. Counted
  # from its end, both arms evaluate at 10 and 20 s; counted from the start, the second arm's
  # evaluations would be at 20 and 30 s and the comparison at 20 s would pit its first
  # evaluation against the first arm's last.
  cached = {k: [(1, 9.0, 2.0), (10, 3.0 + k, 12.0), (20, 2.0 + k, 22.0)] for k in range(2)}
  fresh = {k: [(1, 9.0, 12.0), (10, 2.5 + k, 22.0), (20, 1.5 + k, 32.0)] for k in range(2)}
  a, b = _write_arm(tmp_path / "cached", cached), _write_arm(tmp_path / "fresh", fresh)
  assert _run(capsys, a, b)[0] == 0
  equal_time = json.load(open(tmp_path / "cached" / "compare" / "compare_eval_loss.json"))["equal_time"]
  assert equal_time["seconds"] == 20.0
  assert equal_time["arms"][0]["values"] == {"0": 2.0, "1": 3.0}
  assert equal_time["arms"][1]["values"] == {"0": 1.5, "1": 2.5}
  assert equal_time["arms"][1]["difference"]["mean"] == pytest.approx(-0.5)


def test_equal_time_interpolates_each_seed_at_the_time_every_seed_reached(tmp_path, capsys):
  fast = {k: [(10, 3.0 + k, 10.0), (20, 2.0 + k, 20.0)] for k in range(2)}
  slow = {k: [(10, 2.5 + k, 15.0), (20, 1.0 + k, 30.0)] for k in range(2)}
  a, b = _write_arm(tmp_path / "fast", fast), _write_arm(tmp_path / "slow", slow)
  assert _run(capsys, a, b)[0] == 0
  record = json.load(open(tmp_path / "fast" / "compare" / "compare_eval_loss.json"))
  equal_time = record["equal_time"]
  assert equal_time["seconds"] == 20.0  # the fast arm's last evaluation
  # The slow arm at 20 s: a third of the way from its 15 s to its 30 s evaluation.
  assert equal_time["arms"][1]["values"] == {"0": pytest.approx(2.5 - 1.5 / 3), "1": pytest.approx(3.5 - 1.5 / 3)}
  assert record["equal_tokens"]["arms"][1]["values"] == {"0": 1.0, "1": 2.0}
  assert _run(capsys, a, b, "--at_seconds=16")[0] == 0
  record = json.load(open(tmp_path / "fast" / "compare" / "compare_eval_loss-2.json"))
  assert record["equal_time"]["arms"][0]["values"]["0"] == pytest.approx(3.0 - 0.6)
  # Seeds trained another way: their times do not compare, and the command says so.
  c = _write_arm(tmp_path / "sequential", slow, mode="sequential")
  _, out, _ = _run(capsys, a, c)
  assert "note: equal time: the arms' seeds were trained differently" in out


def test_without_matplotlib_the_plot_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
  a = _write_arm(tmp_path / "A", _final([1.0, 2.0]))
  b = _write_arm(tmp_path / "B", _final([1.5, 2.5]))
  monkeypatch.setitem(sys.modules, "matplotlib", None)
  status, _, err = _run(capsys, a, b)
  assert status == 0
  assert "matplotlib is not installed (pip install -e .[plot]): skipped the plot" in err
  assert sorted(os.listdir(tmp_path / "A" / "compare")) == ["compare_eval_loss.json"]


def test_results_files_of_the_perplexity_command(tmp_path, capsys):
  arms = []
  for name, losses in (("A", [2.0, 3.0]), ("B", [1.0, 2.5])):
    path = _write_arm(tmp_path / name, _final(losses))
    for k, loss in enumerate(losses):
      for suffix, shift in (("", 9.0), ("-2", 0.0)):  # the newer of two evaluations of step 20
        rows = [{"length": n, "loss": loss + shift + n / 100, "perplexity": 1.0, "bits_per_byte": 1.0} for n in (8, 16)]
        record = {"eval": "perplexity", "step": 20, "time": f"2025-01-0{2 if suffix else 1}", "windows": 2}
        _write_eval(path, k, f"perplexity_step20{suffix}.json", {**record, "results": rows})
    arms.append(path)
  status, out, err = _run(capsys, *arms, "--results=perplexity", "--length=8", "--output", tmp_path / "out")
  assert status == 0, err
  record = json.load(open(tmp_path / "out" / "compare_eval_loss.json"))
  assert record["length"] == 8 and record["eval_set"]["perplexity windows"] == 2
  assert record["equal_tokens"]["arms"][1]["values"] == {"0": 1.08, "1": 2.58}
  assert "eval_loss at length 8 at 320 training tokens" in out
  status, _, err = _run(capsys, *arms, "--results=perplexity", "--length=32")
  assert status == 1 and "--length=32: perplexity results of step 20 in" in err and "have lengths [8, 16] only" in err


def test_results_files_of_the_passkey_command_must_be_of_the_same_prompts(tmp_path, capsys):
  arms = []
  for name, accuracies, examples in (("A", [0.5, 0.6], 10), ("B", [0.7, 0.9], 10), ("C", [0.7, 0.9], 20)):
    path = _write_arm(tmp_path / name, _final([1.0, 2.0]))
    for k, accuracy in enumerate(accuracies):
      record = {"eval": "passkey", "step": 20, "time": "2025-01-01", "examples": examples, "digits": 5, "seed": 0}
      record.update(depths="even", align_to=0, top_k=None)
      record["results"] = [{"length": 64, "first_token": 1.0, "all_tokens": accuracy}]
      _write_eval(path, k, "passkey_step20.json", record)
    arms.append(path)
  status, out, err = _run(capsys, arms[0], arms[1], "--results=passkey")
  assert status == 0, err
  record = json.load(open(tmp_path / "A" / "compare" / "compare_all_tokens.json"))
  assert record["equal_tokens"]["arms"][1]["difference"]["mean"] == pytest.approx(0.25)
  status, _, err = _run(capsys, arms[0], arms[2], "--results=passkey")
  assert status == 1 and f"{arms[2]} and {arms[0]} are evaluated on different data (passkey examples 10 vs 20)" in err


def test_results_files_of_the_tasks_command_must_be_of_the_same_task(tmp_path, capsys):
  arms = []
  knobs = {"names": 8, "assignments": 16, "overwrite_rate": 0.5}
  for name, accuracies, rate in (("A", [0.2, 0.3], 0.5), ("B", [0.4, 0.6], 0.5), ("C", [0.4, 0.6], 0.0)):
    path = _write_arm(tmp_path / name, _final([1.0, 2.0]))
    for k, accuracy in enumerate(accuracies):
      record = {"eval": "tasks", "step": 20, "time": "2025-01-01", "task": "variable_tracking", "examples": 50}
      record.update(seed=0, knobs={**knobs, "overwrite_rate": rate})
      record["overall"] = {"query_accuracy": accuracy, "token_accuracy": accuracy, "answer_loss": 2.0 - accuracy}
      _write_eval(path, k, "tasks_variable_tracking_step20.json", record)
    arms.append(path)
  status, out, err = _run(capsys, arms[0], arms[1], "--results=tasks")
  assert status == 0, err
  record = json.load(open(tmp_path / "A" / "compare" / "compare_query_accuracy.json"))
  assert record["equal_tokens"]["arms"][1]["difference"]["mean"] == pytest.approx(0.25)
  status, out, err = _run(capsys, arms[0], arms[1], "--results=tasks", "--metric=answer_loss")
  assert status == 0, err
  status, _, err = _run(capsys, arms[0], arms[2], "--results=tasks")
  assert status == 1 and f"{arms[2]} and {arms[0]} are evaluated on different data (tasks knobs" in err


def test_tasks_results_compare_in_one_bucket_of_a_measure(tmp_path, capsys):
  """--bucket=order:0 reads the first queries' row, whose difference here has the other sign
  from the overall one; a measure or bucket the results lack is one error line."""
  arms = []
  for name, overall, first in (("A", [0.9, 0.8], [0.5, 0.4]), ("B", [0.7, 0.6], [0.7, 0.8])):
    path = _write_arm(tmp_path / name, _final([1.0, 2.0]))
    for k in range(2):
      record = {"eval": "tasks", "step": 20, "time": "2025-01-01", "task": "mqar", "examples": 50, "seed": 0}
      record["knobs"] = {"pairs": 4, "queries": 4, "layout": "compact"}
      scores = lambda a: {"query_accuracy": a, "token_accuracy": a, "answer_loss": 2.0 - a}
      record["overall"] = scores(overall[k])
      record["by"] = {"order": [{"bucket": "0", **scores(first[k])}, {"bucket": "1", **scores(1.0)}]}
      _write_eval(path, k, "tasks_mqar_step20.json", record)
    arms.append(path)
  status, _, err = _run(capsys, arms[0], arms[1], "--results=tasks")
  assert status == 0, err
  record = json.load(open(tmp_path / "A" / "compare" / "compare_query_accuracy.json"))
  assert record["equal_tokens"]["arms"][1]["difference"]["mean"] == pytest.approx(-0.2)
  status, out, err = _run(capsys, arms[0], arms[1], "--results=tasks", "--bucket=order:0")
  assert status == 0, err
  assert "query_accuracy in bucket order:0" in out
  record = json.load(open(tmp_path / "A" / "compare" / "compare_query_accuracy-2.json"))
  assert record["bucket"] == "order:0"
  assert record["equal_tokens"]["arms"][1]["difference"]["mean"] == pytest.approx(0.3)
  for argv, expected in (
    (["--bucket=order:7"], "--bucket=order:7: the tasks results of step 20 in"),
    (["--bucket=distance:0"], "have no measure 'distance'; they have ['order']"),
    (["--bucket=order"], "--bucket=order: pass MEASURE:LABEL, e.g. --bucket=order:0"),
  ):
    status, _, err = _run(capsys, arms[0], arms[1], "--results=tasks", *argv)
    lines = err.strip().splitlines()
    assert status == 1 and len(lines) == 1 and expected in lines[0], err
  status, _, err = _run(capsys, arms[0], arms[1], "--bucket=order:0")
  assert status == 1 and "--bucket applies to --results=tasks, not to --results=metrics" in err


@pytest.fixture()
def paths(tmp_path):
  final = _final([1.0, 2.0])
  single = tmp_path / "single"
  os.makedirs(single)
  (single / "config.json").write_text("{}")
  os.makedirs(tmp_path / "empty")
  os.makedirs(tmp_path / "other_files")
  (tmp_path / "other_files" / "notes.txt").write_text("")
  return {
    "A": _write_arm(tmp_path / "A", final),
    "longer": _write_arm(tmp_path / "longer", final, data={0: {"seq_len": 16}, 1: {"seq_len": 16}}),
    "reshuffled": _write_arm(tmp_path / "reshuffled", final, data={1: {"shuffle_seed": 7}}),
    "late_seeds": _write_arm(tmp_path / "late_seeds", {2: final[0], 3: final[1]}, untrained=(0, 1)),
    "other_steps": _write_arm(tmp_path / "other_steps", {k: [(15, 1.0, 15.0)] for k in range(2)}),
    "no_evals": _write_arm(tmp_path / "no_evals", {k: [] for k in range(2)}),
    "zero": _write_arm(tmp_path / "zero", {}, seeds=0),
    "single": str(single),
    "empty": str(tmp_path / "empty"),
    "other_files": str(tmp_path / "other_files"),
    "nowhere": str(tmp_path / "nowhere"),
  }


@pytest.mark.parametrize(
  "argv, expected",
  [
    (["{A}", "{longer}"], "{longer} and {A} are evaluated on different data (data.seq_len 8 vs 16): compare arms"),
    (
      ["{A}", "{reshuffled}"],
      "seed 1 of {reshuffled} and of {A} read the data in another order (data.shuffle_seed 1 vs 7)",
    ),
    (["{A}", "{late_seeds}"], "{late_seeds} (seeds [2, 3]) and {A} (seeds [0, 1]) have no seed index in common"),
    (
      ["{A}", "{other_steps}"],
      "the arms have no evaluation at a common number of tokens ({A}: [160, 320]; {other_steps}: [240])",
    ),
    (
      ["{A}", "{no_evals}"],
      "{no_evals}: none of its 2 seeds has eval records in metrics.jsonl (train.eval_batches=0?)",
    ),
    (["{A}", "{zero}"], "{zero}/seeds.json records 0 seeds: not a run of several seeds"),
    (["{A}", "{single}"], "{single} holds a single run, not a run of several seeds: each arm must be trained with"),
    (["{empty}", "{A}"], "{empty} is empty: each arm must be the workdir of a run with --config.train.seeds=N"),
    (["{A}", "{other_files}"], "{other_files} is not a run of several seeds (no seeds.json)"),
    (["{A}", "{nowhere}"], "{nowhere}: no such directory"),
    (["{A}", "{A}"], "{A} is given twice: name each arm once"),
    (
      ["{A}", "--metric=accuracy"],
      "--metric=accuracy: with --results=metrics choose one of ['bits_per_byte', 'eval_loss', 'perplexity']",
    ),
    (["{A}", "--length=8"], "--length applies to --results=perplexity or passkey"),
    (["{A}", "--at_tokens=100"], "--at_tokens=100: not a token count every seed has evaluated; common: [160, 320]"),
    (["{A}", "--at_seconds=50"], "--at_seconds=50: every seed has evaluations around times in [10.0, 20.0] only"),
    (
      ["{A}", "--results=passkey"],
      "{A}: none of its 2 seeds has passkey results in eval/ (run python -m castle_jax.eval.passkey",
    ),
    (
      ["{A}", "--results=tasks"],
      "{A}: none of its 2 seeds has tasks results in eval/ (run python -m castle_jax.eval.tasks --workdir=<arm>/seed_<k>",
    ),
    (
      ["{A}", "--results=tasks", "--length=8"],
      "--length applies to --results=perplexity or passkey, not to --results=tasks",
    ),
    ([], "the following arguments are required: arms"),
  ],
)
def test_arms_that_cannot_be_compared_are_one_error_line(paths, capsys, argv, expected):
  status, out, err = _run(capsys, *(a.format(**paths) for a in argv))
  lines = err.strip().splitlines()
  assert status == 1 and len(lines) == 1 and not out, err
  assert lines[0].startswith("ERROR: ") and expected.format(**paths) in lines[0], lines[0]


def test_unpaired_arms_need_the_flag(paths, capsys):
  status, out, _ = _run(capsys, paths["A"], paths["late_seeds"], "--unpaired")
  assert status == 0 and "unpaired (Welch's t test)" in out
  record = json.load(open(os.path.join(paths["A"], "compare", "compare_eval_loss.json")))
  assert not record["paired"] and record["equal_tokens"]["arms"][1]["difference"]["kind"] == "unpaired (Welch)"


def test_two_tiny_arms_trained_on_cpu(tmp_path, stdlib_data_dir, capsys):
  """A baseline and a variant, 2 seeds each (the variant one seed after another), a few steps
  on CPU; then the comparison of their eval records and of their perplexity results."""
  settings = {"train.steps": 4, "train.eval_every": 2, "train.eval_batches": 1, "train.seeds": 2}
  baseline = tiny_run(tiny, str(tmp_path / "baseline"), stdlib_data_dir, **settings)
  variant = tiny_run(tiny, str(tmp_path / "variant"), stdlib_data_dir, **settings, **{"train.learning_rate": 1e-3})
  with variant.unlocked():
    variant.train.seeds_mode = "sequential"
  train(baseline)
  train(variant)
  capsys.readouterr()
  status, out, err = _run(capsys, baseline.workdir, variant.workdir)
  assert status == 0, err
  record = json.load(open(tmp_path / "baseline" / "compare" / "compare_eval_loss.json"))
  assert record["paired"] and record["equal_tokens"]["tokens"] == 4 * 8 * 32
  for arm, workdir in zip(record["equal_tokens"]["arms"], (baseline.workdir, variant.workdir)):
    for k in range(2):
      with open(os.path.join(workdir, f"seed_{k}", "metrics.jsonl")) as f:
        evals = [json.loads(line) for line in f if '"eval"' in line]
      assert arm["values"][str(k)] == [r["loss"] for r in evals if r["step"] == 4][0]
  assert "trained differently" in out  # vmapped against sequential seeds
  # A seed's workdir is a normal one: the evaluation commands read it; their results compare too.
  for workdir in (baseline.workdir, variant.workdir):
    for k in range(2):
      assert perplexity.main([f"--workdir={workdir}/seed_{k}", "--lengths=16", "--windows=1"]) == 0
  capsys.readouterr()
  status, out, err = _run(capsys, baseline.workdir, variant.workdir, "--results=perplexity")
  assert status == 0, err
  assert "eval_loss at length 16 at 1,024 training tokens" in out


def test_a_paired_difference_is_described_in_one_line():
  difference = compare.paired_difference({0: 1.0, 1: 2.0, 2: 1.5, 3: 1.2}, {0: 1.1, 1: 2.3, 2: 1.4, 3: 1.5})
  assert compare.describe_difference(difference) == "+0.150 [-0.155, +0.455], p = 0.215"
  assert (
    compare.describe_difference(compare.paired_difference({0: 1.0}, {0: 1.2})) == "+0.200"
  )  # one seed: no interval, no p
