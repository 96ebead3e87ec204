"""Scoring a model on the mechanism tasks (castle_jax.eval.tasks): the scores against a
direct forward pass and an oracle, buckets, the command's result files (under the
workdir, never overwritten) and its one-line errors."""

import copy
import json
import os
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from castle_jax.data.task_data import parse_knobs, default_knobs, task_examples
from castle_jax.eval import tasks
from castle_jax.workdir import load_trained_model
from configs import tasks_variable_tracking_tiny
from train.trainer import train

# Its module-scoped fixtures are costly (the trained model most tests score): one worker runs
# the whole module under `--dist loadgroup`, so it is trained once.
pytestmark = pytest.mark.xdist_group("test_tasks_eval")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOBS = dict(names=6, assignments=10, overwrite_rate=0.5, queries=3)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """configs/tasks_variable_tracking_tiny.py shrunk to one small layer and 4 steps."""
  c = copy.deepcopy(tasks_variable_tracking_tiny.get_config())
  with c.unlocked():
    c.workdir = str(tmp_path_factory.mktemp("vt") / "run")
    c.model.d_model, c.model.n_layers, c.model.n_heads = 32, 1, 2
    c.data.variable_tracking.update(KNOBS)
    c.data.seq_len, c.data.batch_size = 65, 8
    c.train.update(steps=4, warmup_steps=1, log_every=1, eval_batches=0, checkpoint_every=4, progress_bar=False)
  train(c)
  return c.workdir


def _examples(tokenizer, task="variable_tracking", count=5, **knobs):
  parsed = parse_knobs(task, {**default_knobs(task), **knobs})
  return task_examples(task, tokenizer, parsed, count, seed=3, split="heldout")


def test_scores_match_a_direct_forward_pass(workdir):
  model, params, tokenizer, _ = load_trained_model(workdir)
  examples = _examples(tokenizer, **KNOBS, value_vocab=100)  # two-digit answers
  records = tasks.score_examples(model, params, examples, pad_id=tokenizer.pad_id, batch_size=2)
  assert [(r["example"], r["query"]) for r in records] == [(e, q) for e in range(5) for q in range(3)]
  for record in records:
    example = examples[record["example"]]
    logits, _ = model.apply({"params": params}, example.tokens[None])
    log_probs = np.asarray(jax.nn.log_softmax(logits[0].astype(np.float32)))
    start, size = example.answer_starts[record["query"]], example.answer_lengths[record["query"]]
    positions = np.arange(start, start + size)
    targets = example.tokens[positions]
    assert record["answer_tokens"] == size == 2
    np.testing.assert_allclose(record["nll"], -log_probs[positions - 1, targets].sum(), rtol=1e-4, atol=1e-4)
    assert record["correct_tokens"] == (log_probs[positions - 1].argmax(-1) == targets).sum()
    assert record["overwrites"] == example.measures["overwrites"][record["query"]]


def _oracle_family(shift):
  """A model family whose logits put all mass on the true next token (shift=0), or on
  the token `shift` positions later."""

  def last_logits(model, params, tokens, count):
    tokens = np.asarray(tokens)
    following = np.roll(tokens, -1 - shift, axis=1)[:, -count:]
    return np.where(np.arange(400) == following[..., None], 30.0, 0.0).astype(np.float32)

  return lambda model: types.SimpleNamespace(last_logits=last_logits)


@pytest.mark.parametrize("task", ["variable_tracking", "mqar"])
def test_an_oracle_scores_one_and_a_shifted_oracle_zero(task, monkeypatch, workdir):
  _, _, tokenizer, _ = load_trained_model(workdir)
  monkeypatch.setattr(tasks, "family_of", _oracle_family(0))
  result = tasks.evaluate_task(None, None, tokenizer, task, {"value_vocab": 1000}, examples=7, batch_size=3)
  overall = result["overall"]
  assert overall["query_accuracy"] == overall["token_accuracy"] == 1.0 and overall["answer_loss"] < 1e-6
  assert overall["queries"] == 7 * default_knobs(task)["queries"] and overall["answer_tokens"] == 3 * overall["queries"]
  monkeypatch.setattr(tasks, "family_of", _oracle_family(1))
  result = tasks.evaluate_task(None, None, tokenizer, task, {"value_vocab": 1000}, examples=7, batch_size=3)
  # The answer's last token is never the one after it.
  assert result["overall"]["query_accuracy"] == 0.0 and result["overall"]["answer_loss"] > 5


def test_results_by_bucket_add_up(workdir):
  model, params, tokenizer, _ = load_trained_model(workdir)
  result = tasks.evaluate_task(model, params, tokenizer, "variable_tracking", KNOBS, examples=20, seed=1)
  assert result["knobs"] == {**default_knobs("variable_tracking"), **KNOBS}
  assert result["chance_query_accuracy"] == 0.1 and len(result["per_query"]) == 60
  assert set(result["by"]) == {"overwrites", "distance", "token_distance"}
  for measure, buckets in result["by"].items():
    assert sum(b["queries"] for b in buckets) == 60
    correct = sum(b["query_accuracy"] * b["queries"] for b in buckets)
    assert correct == pytest.approx(result["overall"]["query_accuracy"] * 60)
    lows = [int(b["bucket"].split("-")[0]) for b in buckets]
    assert lows == sorted(set(lows))
  control = tasks.evaluate_task(
    model, params, tokenizer, "variable_tracking", {**KNOBS, "overwrite_rate": 0.0, "assignments": 6}, examples=5
  )
  assert [b["bucket"] for b in control["by"]["overwrites"]] == ["0"]
  mqar = tasks.evaluate_task(model, params, tokenizer, "mqar", {"pairs": 6, "queries": 6}, examples=3)
  assert set(mqar["by"]) == {"distance", "token_distance", "order"}
  # Each query order is its own bucket: the first query is the one elimination cannot answer.
  assert [b["bucket"] for b in mqar["by"]["order"]] == [str(q) for q in range(6)]
  first = [r for r in mqar["per_query"] if r["query"] == 0]
  assert mqar["by"]["order"][0]["query_accuracy"] == pytest.approx(
    np.mean([r["correct_tokens"] == r["answer_tokens"] for r in first])
  )


def test_buckets():
  labels = [tasks.bucket_of("distance", v)[1] for v in (0, 1, 2, 3, 4, 7, 8, 100)]
  assert labels == ["0", "1", "2-3", "2-3", "4-7", "4-7", "8-15", "64-127"]
  assert [tasks.bucket_of("overwrites", v)[1] for v in (0, 1, 5, 12)] == ["0", "1", "5", "12"]
  assert [tasks.bucket_of("order", v)[1] for v in (0, 1, 5, 12)] == ["0", "1", "5", "12"]


def test_bad_python_arguments(workdir):
  model, params, tokenizer, _ = load_trained_model(workdir)
  with pytest.raises(ValueError, match="examples must be an int >= 1, got 0"):
    tasks.evaluate_task(model, params, tokenizer, "mqar", examples=0)
  with pytest.raises(ValueError, match=r"data.mqar.pairs must be an int in \[1, 26\]"):
    tasks.evaluate_task(model, params, tokenizer, "mqar", {"pairs": 30})


def test_command_writes_new_files_under_the_workdir(workdir, capsys, monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)  # nothing may land in the current directory
  flags = [f"--workdir={workdir}", "--examples=4", "--batch_size=4"]
  assert tasks.main(flags) == 0
  assert (
    tasks.main(
      [
        *flags,
        "--config.data.variable_tracking.overwrite_rate=0",
        "--config.data.variable_tracking.assignments=6",
        "--seed=2",
      ]
    )
    == 0
  )
  out = capsys.readouterr().out
  assert "variable_tracking at step 4: 4 examples, 12 queries" in out and "overwrites" in out
  files = sorted(os.listdir(os.path.join(workdir, "eval")))
  assert len(files) == 2 and files == ["tasks_variable_tracking_step4-2.json", "tasks_variable_tracking_step4.json"], (
    files
  )
  assert os.listdir(tmp_path) == []
  records = []
  for name in files:
    with open(os.path.join(workdir, "eval", name)) as f:
      records.append(json.load(f))
  first, second = sorted(records, key=lambda r: r["seed"])
  assert (first["eval"], first["task"], first["step"], first["split"]) == ("tasks", "variable_tracking", 4, "heldout")
  assert first["workdir"] == workdir and first["knobs"] == {**default_knobs("variable_tracking"), **KNOBS}
  assert second["knobs"]["overwrite_rate"] == 0.0 and [b["bucket"] for b in second["by"]["overwrites"]] == ["0"]
  assert len(first["per_query"]) == 12 and first["overall"]["queries"] == 12
  output = tmp_path / "mine.json"
  assert tasks.main([*flags, f"--output={output}", "--task=mqar", "--config.data.mqar.pairs=5"]) == 0
  with open(output) as f:
    assert json.load(f)["knobs"]["pairs"] == 5


@pytest.fixture(scope="module")
def lm_workdir(workdir, tmp_path_factory):
  """The trained workdir, recorded as trained on data.task="lm"."""
  copy_dir = str(tmp_path_factory.mktemp("lm") / "run")
  shutil.copytree(workdir, copy_dir)
  path = os.path.join(copy_dir, "config.json")
  with open(path) as f:
    config = json.load(f)
  config["data"]["task"] = "lm"
  with open(path, "w") as f:
    json.dump(config, f)
  return copy_dir


@pytest.mark.parametrize(
  "flags, message",
  [
    ([], "one of the arguments --workdir --pretrained is required"),
    (["--workdir={vt}", "--examples=0"], "--examples must be an integer >= 1, got 0"),
    (["--workdir={vt}", "--batch_size=0"], "--batch_size must be an integer >= 1, got 0"),
    (["--workdir={vt}", "--examples=many"], "--examples='many' is not an integer"),
    (["--workdir={vt}", "--task=copy"], "argument --task: invalid choice: 'copy'"),
    (["--workdir={lm}"], "--task is needed: the model trained data.task='lm'; pass --task=variable_tracking or"),
    (
      ["--workdir={vt}", "--config.data.variable_tracking.names=0"],
      "data.variable_tracking.names must be an int in [1, 26] (at most data.variable_tracking.name_vocab=26), got 0",
    ),
    (
      ["--workdir={vt}", "--config.data.variable_tracking.overwrite_rate=2"],
      "data.variable_tracking.overwrite_rate must be a number in [0, 1], got 2.0",
    ),
    (
      ["--workdir={vt}", "--config.data.variable_tracking.names=abc"],
      "--config.data.variable_tracking.names must be an int, got 'abc'",
    ),
    (
      ["--workdir={vt}", "--config.data.variable_tracking.nmes=3"],
      "--config.data.variable_tracking.nmes is not a knob of variable_tracking; the knobs are",
    ),
    (
      ["--workdir={vt}", "--config.data.mqar.pairs=3"],
      "--config.data.mqar.pairs does not apply to --task=variable_tracking",
    ),
    (["--workdir={vt}", "--bogus=1"], "unrecognized argument '--bogus=1'"),
    (["--workdir={vt}", "--output={existing}"], "exists (results of an earlier run are never replaced)"),
    (["--workdir={missing}"], "config.json not found: --workdir must be a training workdir (written by"),
    (["--workdir={vt}", "--step=3"], "No checkpoint for step 3 in"),
  ],
)
def test_bad_flags_are_one_error_line(flags, message, workdir, lm_workdir, tmp_path, capsys):
  existing = tmp_path / "old.json"
  existing.write_text("{}")
  flags = [f.format(vt=workdir, lm=lm_workdir, missing=tmp_path / "nowhere", existing=existing) for f in flags]
  assert tasks.main(flags) == 1
  out, err = capsys.readouterr()
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("ERROR: ") and message in lines[0], err
  assert out == "" and existing.read_text() == "{}"


def test_command_line_exit_status(workdir):
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "castle_jax.eval.tasks",
      f"--workdir={workdir}",
      "--config.data.variable_tracking.queries=9",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "PYTHONPATH": ROOT},
  )
  assert done.returncode == 1
  assert done.stderr.strip().splitlines() == [
    "ERROR: data.variable_tracking.queries must be an int in [1, 6] (distinct names assigned before the last "
    "distance=0 statements: at most names and assignments - distance), got 9"
  ]
