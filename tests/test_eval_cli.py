"""The evaluation commands on tiny trained workdirs: passkey (drt_tiny, and an oracle
model through the `last_logits` hook) and perplexity (drt_tiny, swa_tiny), their JSON and
plot, and one-line errors for bad flags."""

import dataclasses
import importlib.util
import json
import math
import os
import shutil

import numpy as np
import pytest

import forked_commands
from castle_jax.eval import passkey, perplexity
from castle_jax.models import registry
from configs import drt_tiny, swa_tiny
from helpers import tiny_run
from train.trainer import train

# Its module-scoped fixtures are costly (trained models, compiled steps): one worker runs the
# whole module under `--dist loadgroup`, so they are built once.
pytestmark = pytest.mark.xdist_group("test_eval_cli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
DRT_SETTINGS = {
  "model.n_layers": 2,
  "data.seq_len": 64,
  "train.steps": 4,
  "model.family_kwargs": dict(chunk_size=8, top_k=2, retrieval_groups=1, encoder_layers=1),
}


@pytest.fixture(scope="module")
def drt_workdir(tmp_path_factory, stdlib_data_dir):
  config = tiny_run(drt_tiny, str(tmp_path_factory.mktemp("drt") / "run"), stdlib_data_dir, **DRT_SETTINGS)
  train(config)
  return config.workdir


def _read(path):
  with open(path) as f:
    return json.load(f)


def _check_plot(json_path, stderr):
  png = json_path[: -len(".json")] + ".png"
  if HAS_MATPLOTLIB:
    assert os.path.getsize(png) > 0
  else:
    assert "matplotlib is not installed" in stderr and not os.path.exists(png)


def test_passkey_cli_writes_table_json_and_plot(drt_workdir, tmp_path, capsys):
  assert (
    passkey.main(
      [f"--workdir={drt_workdir}", "--lengths=96,160", "--examples=3", "--batch_size=3", f"--output={tmp_path}"]
    )
    == 0
  )
  out, err = capsys.readouterr()
  assert out.splitlines()[0].split() == ["length", "first-token", "acc", "all-token", "acc", "examples", "seconds"]
  record = _read(tmp_path / "passkey_step4.json")
  assert (record["eval"], record["step"], record["family"], record["align_to"]) == ("passkey", 4, "drt", 8)
  assert record["workdir"] == drt_workdir and record["config"]["model"]["d_model"] == 32
  assert [r["length"] for r in record["results"]] == [96, 160]
  for result in record["results"]:
    assert result["examples"] == 3 and len(result["per_example"]) == 3 and result["seconds"] > 0
    assert 0 <= result["all_tokens"] <= result["first_token"] <= 1
    depths = [e["depth"] for e in result["per_example"]]
    assert depths == sorted(depths)  # --depths=even: spread over the context
  # Example i has the same passkey at every length.
  assert [e["passkey"] for e in record["results"][0]["per_example"]] == [
    e["passkey"] for e in record["results"][1]["per_example"]
  ]
  _check_plot(str(tmp_path / "passkey_step4.json"), err)


def test_passkey_cli_scores_the_tail_logits_of_the_hook(drt_workdir, tmp_path, monkeypatch):
  """An oracle `last_logits` (one-hot on each true next token) scores 1.0; one that is
  one position early scores 0: the CLI reads exactly the rows the hook returns."""
  calls = []

  def oracle(shift):
    def last_logits(module, params, tokens, count):
      tokens = np.asarray(tokens)
      calls.append((tokens.shape, count))
      length = tokens.shape[1]
      logits = np.zeros((tokens.shape[0], count, 260), np.float32)
      for row in range(count):
        position = length - count + row + 1 + shift  # the token this row predicts
        if position < length:
          logits[np.arange(tokens.shape[0]), row, tokens[:, position]] = 1.0
      return logits

    return last_logits

  for shift, expected in ((0, 1.0), (-1, 0.0)):  # -1: each row "predicts" its own input token
    monkeypatch.setitem(
      registry.MODEL_FAMILIES, "drt", dataclasses.replace(registry.MODEL_FAMILIES["drt"], last_logits=oracle(shift))
    )
    output = str(tmp_path / f"shift{shift}.json")
    assert (
      passkey.main(
        [
          f"--workdir={drt_workdir}",
          "--lengths=80",
          "--examples=4",
          "--batch_size=2",
          "--digits=6",
          f"--output={output}",
        ]
      )
      == 0
    )
    result = _read(output)["results"][0]
    assert (result["first_token"], result["all_tokens"]) == (expected, expected)
  assert calls[0][0] == (2, 80) and calls[0][1] < 20  # only the tail is asked for


def test_perplexity_cli_on_drt(drt_workdir, tmp_path, capsys):
  assert (
    perplexity.main(
      [f"--workdir={drt_workdir}", "--lengths=64,128", "--windows=2", f"--output={tmp_path / 'ppl.json'}"]
    )
    == 0
  )
  out, err = capsys.readouterr()
  assert out.splitlines()[0].split()[:4] == ["length", "windows", "tokens", "loss"]
  record = _read(tmp_path / "ppl.json")
  assert (record["eval"], record["step"], record["windows"], record["skipped"]) == ("perplexity", 4, 2, [])
  for result, length in zip(record["results"], (64, 128)):
    assert result["length"] == length and result["tokens"] == 2 * length
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    # byte tokenizer: a byte per token except BOS/EOS, which stand for none
    assert result["bits_per_byte"] >= result["loss"] / math.log(2)
    assert 0 < result["loss"] < 8
  _check_plot(str(tmp_path / "ppl.json"), err)


def test_perplexity_cli_on_swa_skips_lengths_the_split_cannot_fill(tmp_path, stdlib_data_dir, small_source_dir, capsys):
  config = tiny_run(
    swa_tiny, str(tmp_path / "swa"), str(tmp_path / "tfds"), **{"data.source_dir": small_source_dir, "train.steps": 2}
  )
  train(config)
  capsys.readouterr()
  assert (
    perplexity.main(
      [f"--workdir={config.workdir}", "--lengths=32,100000", "--windows=1", f"--output={tmp_path / 'out'}"]
    )
    == 0
  )
  _, err = capsys.readouterr()
  record = _read(tmp_path / "out" / "perplexity_step2.json")
  assert [r["length"] for r in record["results"]] == [32] and record["family"] == "transformer"
  assert [s["length"] for s in record["skipped"]] == [100000]
  assert "length 100,000 skipped: 1 windows need 100,001 tokens, the validation split" in err
  assert perplexity.main([f"--workdir={config.workdir}", "--lengths=100000"]) == 1
  assert "ERROR: --lengths=100000: no length fits the validation split" in capsys.readouterr().err


@pytest.mark.parametrize(
  "module, flags, message",
  [
    (passkey, [], "one of the arguments --workdir --pretrained is required"),
    (
      passkey,
      ["--workdir={drt}", "--pretrained=drt_tiny_retrieval_topk"],
      "argument --pretrained: not allowed with argument --workdir",
    ),
    (
      passkey,
      ["--pretrained=drt_tiny"],
      "argument --pretrained: invalid choice: 'drt_tiny' (choose from 'drt_tiny_retrieval_topk', ",
    ),
    (passkey, ["--pretrained=drt_tiny_retrieval_topk", "--step=3"], "--step must be left out with --pretrained"),
    (passkey, ["--workdir={missing}"], "config.json not found: --workdir must be a training workdir (written by"),
    (passkey, ["--workdir={drt}", "--lengths=1k"], "--lengths='1k' must be comma-separated integers"),
    (passkey, ["--workdir={drt}", "--lengths=0,8"], "--lengths='0,8' must list lengths >= 2"),
    (passkey, ["--workdir={drt}", "--examples=0"], "--examples must be an integer >= 1, got 0"),
    (passkey, ["--workdir={drt}", "--lengths=40"], "--lengths: length 40 is too short for a passkey prompt"),
    (passkey, ["--workdir={drt}", "--step=3"], "No checkpoint for step 3 in"),
    (passkey, ["--workdir={drt}", "--depths=middle"], "argument --depths: invalid choice: 'middle'"),
    (perplexity, ["--workdir={drt}", "--windows=-1"], "--windows must be an integer >= 1, got -1"),
    (perplexity, ["--workdir={drt}", "--bogus=1"], "unrecognized arguments: --bogus=1"),
  ],
)
def test_bad_flags_are_one_error_line(module, flags, message, drt_workdir, tmp_path, capsys):
  flags = [f.format(missing=tmp_path / "nowhere", drt=drt_workdir) for f in flags]
  assert module.main(flags) == 1
  out, err = capsys.readouterr()
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("ERROR: ") and message in lines[0], err
  assert out == ""


@pytest.mark.parametrize("module", ["castle_jax.eval.passkey", "castle_jax.eval.perplexity"])
def test_command_line_help_and_missing_workdir(module, tmp_path):
  # Both command lines in processes forked from one that has imported jax and the rest.
  (helped, done), import_stderr = forked_commands.run(
    [["-m", module, "--help"], ["-m", module, f"--workdir={tmp_path}"]], ROOT, {**os.environ, "PYTHONPATH": ROOT}
  )
  assert not import_stderr.strip(), import_stderr  # the imports a command alone would print too
  assert helped.returncode == 0 and "--workdir" in helped.stdout and "--lengths" in helped.stdout
  assert done.returncode == 1
  assert done.stderr.strip().splitlines() == [
    f"ERROR: {tmp_path}/config.json not found: --workdir must be a training workdir (written by `python -m "
    "train`: config.json, checkpoints/) or a Hugging Face model directory (config.json with a model_type, "
    "*.safetensors weights, tokenizer.json)"
  ]


def test_passkey_top_k_flag_sets_the_retrieved_chunks(drt_workdir, tmp_path, monkeypatch, capsys):
  seen = []

  def last_logits(module, params, tokens, count):
    seen.append(module.options.top_k)
    return np.zeros((tokens.shape[0], count, 260), np.float32)

  monkeypatch.setitem(
    registry.MODEL_FAMILIES, "drt", dataclasses.replace(registry.MODEL_FAMILIES["drt"], last_logits=last_logits)
  )
  for flags, expected in (([], DRT_SETTINGS["model.family_kwargs"]["top_k"]), (["--top_k=5"], 5)):
    output = str(tmp_path / f"k{expected}.json")
    assert passkey.main([f"--workdir={drt_workdir}", "--lengths=80", "--examples=1", f"--output={output}", *flags]) == 0
    assert seen[-1] == expected and _read(output)["top_k"] == (5 if flags else None)
  capsys.readouterr()
  assert passkey.main([f"--workdir={drt_workdir}", "--top_k=0"]) == 1
  assert "ERROR: --top_k must be an integer >= 1, got 0" in capsys.readouterr().err


def test_passkey_cli_evaluates_a_shipped_model(tmp_path, stdlib_data_dir, monkeypatch):
  # No --output: the user's cache, never the current directory.
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  monkeypatch.chdir(tmp_path)
  flags = ["--pretrained=drt_tiny_retrieval_topk", "--lengths=1024", "--examples=2", f"--data_dir={stdlib_data_dir}"]
  assert passkey.main(flags) == 0
  assert sorted(os.listdir(tmp_path)) == ["cache"]
  output = tmp_path / "cache" / "castle_jax" / "eval" / "drt_tiny_retrieval_topk" / "passkey_step5000.json"
  record = json.load(open(output))
  assert record["pretrained"] == "drt_tiny_retrieval_topk" and "workdir" not in record
  assert record["step"] == 5000 and record["config"]["model"]["family"] == "drt"
  # The trained model reads the needle's chunk and copies the digits (a random one gets none).
  assert record["results"][0]["all_tokens"] == 1.0


def test_a_second_evaluation_never_replaces_the_first(drt_workdir, tmp_path, capsys):
  """Default output: <workdir>/eval/, where each evaluation gets its own file; a named
  --output file that exists is refused before anything is computed."""
  eval_dir = os.path.join(drt_workdir, "eval")
  shutil.rmtree(eval_dir, ignore_errors=True)
  assert perplexity.main([f"--workdir={drt_workdir}", "--lengths=32", "--windows=1"]) == 0
  first = open(os.path.join(eval_dir, "perplexity_step4.json")).read()
  assert perplexity.main([f"--workdir={drt_workdir}", "--lengths=64", "--windows=1"]) == 0
  assert open(os.path.join(eval_dir, "perplexity_step4.json")).read() == first
  assert [r["length"] for r in _read(os.path.join(eval_dir, "perplexity_step4-2.json"))["results"]] == [64]
  assert f"wrote {eval_dir}/perplexity_step4-2.json" in capsys.readouterr().out
  if HAS_MATPLOTLIB:
    assert sorted(os.listdir(eval_dir)) == [
      "perplexity_step4-2.json",
      "perplexity_step4-2.png",
      "perplexity_step4.json",
      "perplexity_step4.png",
    ]
  named = tmp_path / "mine.json"
  named.write_text("{}")
  assert perplexity.main([f"--workdir={drt_workdir}", "--lengths=32", f"--output={named}"]) == 1
  assert capsys.readouterr().err.strip() == (
    f"ERROR: --output={named}: {named} exists (results of an earlier run are never replaced); pass a new name, "
    "or move that file away first"
  )
  assert named.read_text() == "{}"
