"""A Hugging Face model directory where a trained workdir goes: `load_trained_model`,
`python -m train.generate`, the perplexity command, and a LongSpec draft's frozen target
(`model.family_kwargs.target_workdir`), on the tiny fixtures of tests/fixtures/hf/."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from castle_jax.config import ModelConfig
from castle_jax.eval import perplexity
from castle_jax.models import longspec_draft
from castle_jax.models.hf import hf_model_config
from castle_jax.workdir import (
  HF_STEP,
  frozen_record,
  load_draft,
  load_frozen_params,
  load_trained_model,
  load_workdir_tokenizer,
  params_fingerprint,
  read_config,
  with_hf_frozen_source,
)
from benchmarks import longspec as longspec_benchmark
from configs import longspec_draft_tiny, tiny
from helpers import tiny_run
from test_hf_import import FIXTURES, NAMES, copy_fixture, reference
from train.generate import continue_prompt
from train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "the quick brown fox"


def _fixture(name):
  return os.path.join(FIXTURES, name)


def _command(*args):
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
  ran = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert ran.returncode == 0, ran.stderr[-2000:]
  return ran.stdout


def _text_prompt(tokenizer):
  """The prompt `train.generate --prompt=PROMPT` decodes from: BOS, then the text."""
  return np.concatenate([[tokenizer.bos_id], tokenizer.encode(PROMPT)]).astype(np.int32)


@pytest.mark.parametrize("name", NAMES)
def test_an_hf_directory_loads_as_a_trained_model_and_decodes_transformers_tokens(name):
  target = load_trained_model(_fixture(name))
  assert target.step == HF_STEP
  ref = reference(name)
  new_tokens = ref["generated"].shape[1] - ref["input_ids"].shape[1]
  tokens, speculative = continue_prompt(target, ref["input_ids"][0], max_new_tokens=new_tokens)
  np.testing.assert_array_equal(tokens, ref["generated"][0])
  assert speculative is None
  config = read_config(_fixture(name))
  assert ModelConfig.from_mapping(config.model) == target.model.config
  assert load_workdir_tokenizer(_fixture(name)).encode(PROMPT).tolist() == target.tokenizer.encode(PROMPT).tolist()


def test_generate_command_on_an_hf_directory():
  target = load_trained_model(_fixture("llama3"))
  expected, _ = continue_prompt(target, _text_prompt(target.tokenizer), max_new_tokens=8)
  out = _command(
    "-m",
    "train.generate",
    f"--workdir={_fixture('llama3')}",
    f"--prompt={PROMPT}",
    "--max_new_tokens=8",
    "--temperature=0",
  )
  lines = out.splitlines()
  assert lines[-2] == f"# step {HF_STEP}, temperature 0.0"
  assert lines[-1] == target.tokenizer.decode(expected[1:])


def test_perplexity_command_on_an_hf_directory(stdlib_data_dir, tmp_path, monkeypatch, capsys):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  before = sorted(os.listdir(_fixture("qwen2")))
  args = [f"--workdir={_fixture('qwen2')}", "--lengths=16,32", "--windows=2", f"--data_dir={stdlib_data_dir}"]
  assert perplexity.main(args) == 0
  written = tmp_path / "castle_jax" / "eval" / "qwen2" / "perplexity_step0.json"
  assert f"wrote {written}" in capsys.readouterr().out
  record = json.loads(written.read_text())
  assert record["step"] == HF_STEP and record["workdir"] == _fixture("qwen2")
  assert [r["length"] for r in record["results"]] == [16, 32]
  # The byte counts come from the HF tokenizer, so bits per byte are finite and positive.
  assert all(0 < r["loss"] < 10 and 0 < r["bits_per_byte"] < 20 for r in record["results"])
  assert sorted(os.listdir(_fixture("qwen2"))) == before  # nothing written into the model's directory
  assert perplexity.main([*args, "--step=3"]) == 1
  assert "ERROR: --step=3: " in capsys.readouterr().err


def test_bad_directories_are_named(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(
    FileNotFoundError,
    match=r"empty/config.json not found: --workdir must be a training workdir \(written by `python -m train`: "
    r"config.json, checkpoints/\) or a Hugging Face model directory \(config.json with a model_type",
  ):
    load_trained_model(str(empty))
  odd = tmp_path / "odd"
  odd.mkdir()
  (odd / "config.json").write_text('{"hidden_size": 8}')
  with pytest.raises(ValueError, match=r"has neither a training run's model section nor a Hugging Face model_type"):
    load_trained_model(str(odd))
  with pytest.raises(ValueError, match=r"--step=2: .*llama3 is a Hugging Face model directory.*leave --step out"):
    load_trained_model(_fixture("llama3"), 2)
  directory = copy_fixture("llama2", tmp_path)
  os.remove(directory / "model.safetensors")
  with pytest.raises(ValueError, match=r"no weights in .*llama2: expected model.safetensors"):
    load_trained_model(str(directory))


def _draft_config(name, workdir, data_dir, **overrides):
  config = tiny_run(
    longspec_draft_tiny, str(workdir), data_dir, **{"train.steps": 4, "train.checkpoint_every": 4, **overrides}
  )
  with config.unlocked():
    config.model.family_kwargs.target_workdir = _fixture(name)
    config.model.family_kwargs.window = 16
    config.model.family_kwargs.max_offset = 32
  return config


def test_an_hf_target_fixes_the_draft_config_and_refuses_a_step(stdlib_data_dir, tmp_path):
  config = _draft_config("qwen2", tmp_path / "draft", stdlib_data_dir)
  adopted, note = with_hf_frozen_source(config)
  assert "is a Hugging Face model directory: took model.vocab_size=96" in note
  assert "model.qkv_bias=True" in note and f"data.tokenizer={_fixture('qwen2')!r}" in note
  target = hf_model_config(_fixture("qwen2"))
  draft = ModelConfig.from_mapping(adopted.model)
  assert longspec_draft.width_differences(target, draft) == []
  # The draft's own numerics and options stay the config's.
  assert (draft.family, draft.dtype, draft.init_std) == ("longspec_draft", config.model.dtype, config.model.init_std)
  assert dict(draft.family_kwargs)["window"] == 16
  assert with_hf_frozen_source(adopted) == (adopted, None)
  plain = tiny_run(tiny, str(tmp_path / "plain"), stdlib_data_dir)
  assert with_hf_frozen_source(plain) == (plain, None)
  stepped = dataclasses.replace(draft, family_kwargs=(*draft.family_kwargs, ("target_step", 3)))
  with pytest.raises(
    ValueError,
    match=r"model.family_kwargs.target_step=3: model.family_kwargs.target_workdir=.*qwen2 is a Hugging Face "
    r"model directory, whose weights have no checkpoint steps; leave model.family_kwargs.target_step out",
  ):
    load_frozen_params(stepped)


# Qwen2 (biases, and the generate command too) in the default suite; Llama 3 with -m slow.
@pytest.mark.parametrize("name", [pytest.param("llama3", marks=pytest.mark.slow), "qwen2"])
def test_a_draft_trains_against_an_hf_target_and_decodes_as_the_target(name, stdlib_data_dir, tmp_path, capfd):
  config = _draft_config(name, tmp_path / "draft", stdlib_data_dir)
  result = train(config)
  assert f"target_workdir={_fixture(name)} is a Hugging Face model directory: took" in capfd.readouterr().err
  target = load_trained_model(_fixture(name))
  assert frozen_record(config.workdir)["fingerprint"] == params_fingerprint({"target": target.params})
  saved = read_config(config.workdir)
  assert saved.data.tokenizer == _fixture(name)  # named, not copied: its special ids are in its config.json
  assert not os.path.exists(os.path.join(config.workdir, "tokenizer.json"))
  # A Qwen2 target's query/key/value biases are mirrored in the draft's own self-attention.
  query = result.state.params["self_attention"]["query"]
  assert ("bias" in query) == (name == "qwen2")
  assert sum(x.size for x in jax.tree.leaves(result.state.params)) == longspec_draft.param_count(
    ModelConfig.from_mapping(saved.model)
  )

  draft = load_draft(config.workdir, target)
  prompt = _text_prompt(target.tokenizer)
  alone, _ = continue_prompt(target, prompt, max_new_tokens=16)
  speculative, line = continue_prompt(target, prompt, max_new_tokens=16, draft=draft, tree=(2, 4, 4))
  np.testing.assert_array_equal(speculative, alone)
  assert line.startswith("# speculative: draft step 4, tree [2, 4, 4]: tau")
  if name != "qwen2":
    return  # the command runs continue_prompt as above: once, for the target with biases, is enough
  # The decoding above, whose compiled programs the command finds in the compilation cache.
  out = _command(
    "-m",
    "train.generate",
    f"--workdir={_fixture(name)}",
    f"--draft_workdir={config.workdir}",
    f"--prompt={PROMPT}",
    "--max_new_tokens=16",
    "--temperature=0",
    "--tree=2,4,4",
  )
  lines = out.splitlines()
  assert lines[-3].startswith("# speculative: draft step 4, tree [2, 4, 4]: tau")
  assert lines[-1] == target.tokenizer.decode(alone[1:])
  # The LongSpec benchmark decodes a batch of different prompts, each row as the target alone.
  rows = longspec_benchmark.main(
    [
      f"--target_workdir={_fixture(name)}",
      f"--draft={config.workdir}",
      "--prompt_lengths=24",
      "--new_tokens=6",
      "--prompts=1",
      "--temperatures=0",
      "--tree=2,4",
      "--batch_sizes=3",  # batch 1 runs through the same code in test_longspec.py
      "--dtype=float32",
    ]
  )
  assert [(row["batch"], row["identical_to_autoregressive"]) for row in rows] == [(3, True)]
  assert all(row["tau"] >= 1 and row["target_forwards"] >= 1 for row in rows)
