"""train.init_from a Hugging Face model directory: a fresh run starts from its weights (fresh
optimizer state, step 0), with its model config (configs/hf_finetune.py) and tokenizer; a
config that differs in either is one clear error before anything is written. On the tiny
fixtures of tests/fixtures/hf/."""

import copy
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

from castle_jax.config import ModelConfig
from castle_jax.models.hf import finetune_model_settings, hf_model_config, load_hf_params
from castle_jax.models.registry import abstract_params, build_model
from castle_jax.workdir import restore_params
from configs import hf_finetune, tiny
from helpers import TINY_RUN_SETTINGS
from test_hf_import import FIXTURES
from train.metrics import read_metrics
from train.resume_checks import ConfigMismatchError, check_init_from
from train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two steps whose first has learning rate 0 (the warm-up starts at 0): the checkpoint of step 1
# holds the starting parameters exactly, that of step 2 trained ones.
RUN = {
  "model.dtype": "float32",
  "data.seq_len": 32,
  "data.batch_size": 8,
  "train.steps": 2,
  "train.warmup_steps": 2,
  "train.learning_rate": 1e-2,
  "train.log_every": 1,
  "train.eval_every": 2,
  "train.eval_batches": 1,
  "train.checkpoint_every": 1,
  "train.progress_bar": False,
}


def _fixture(name):
  return os.path.join(FIXTURES, name)


def _config(module, workdir, data_dir, *args, **overrides):
  config = copy.deepcopy(module.get_config(*args))
  with config.unlocked():
    config.workdir = str(workdir)
    config.data.data_dir = data_dir
    for key, value in overrides.items():
      section, name = key.split(".")
      config[section][name] = value
  return config


def _checkpoint_params(workdir, name, step):
  abstract = abstract_params(build_model(hf_model_config(_fixture(name))), 8)
  params, restored = restore_params(workdir, abstract, step=step)
  assert restored == step
  return params


def _hf_params(name):
  return load_hf_params(_fixture(name), hf_model_config(_fixture(name)))


def _assert_started_from_the_hf_weights(workdir, name):
  hf = _hf_params(name)
  start = _checkpoint_params(workdir, name, 1)
  jax.tree.map(np.testing.assert_array_equal, start, hf)
  trained = _checkpoint_params(workdir, name, 2)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), trained, hf))
  assert any(moved)
  metrics = os.path.join(workdir, "metrics.jsonl")
  assert read_metrics(metrics)[1]["learning_rate"] == 0.0
  assert read_metrics(metrics, split="init_from")[0]["source_step"] == 0
  saved = json.load(open(os.path.join(workdir, "config.json")))
  assert saved["train"]["init_from"] == _fixture(name)  # where the run started, absolute
  assert saved["data"]["tokenizer"] == _fixture(name)
  assert ModelConfig.from_mapping(saved["model"]) == hf_model_config(_fixture(name))


def _adam_count(opt_state):
  (count,) = [
    s.count
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if isinstance(s, optax.ScaleByAdamState)
  ]
  return int(count)


def test_a_run_starts_from_the_hf_weights_with_a_fresh_optimizer(stdlib_data_dir, tmp_path, capfd):
  # On a mesh of data 2 x fsdp 2 x tensor 2: the weights go into sharded parameters.
  mesh = {"mesh.fsdp": 2, "mesh.tensor": 2}
  config = _config(hf_finetune, tmp_path / "llama", stdlib_data_dir, _fixture("llama3"), **RUN, **mesh)
  result = train(config)
  out, err = capfd.readouterr()
  assert f"Initialised the parameters from the Hugging Face weights in {_fixture('llama3')} (train.init_from)" in err
  assert "optimizer state and the step start fresh" in err
  assert f"parameters of the Hugging Face weights in {_fixture('llama3')}" in out
  assert int(result.state.step) == 2 and _adam_count(result.state.opt_state) == 2
  query = result.state.params["block_0"]["attention"]["query"]["kernel"]
  assert len(query.sharding.device_set) == 8 and not query.sharding.is_fully_replicated
  assert np.isfinite(result.last_train_metrics["loss"])
  _assert_started_from_the_hf_weights(config.workdir, "llama3")


def test_the_train_command_fine_tunes_an_hf_directory(stdlib_data_dir, tmp_path):
  """Qwen2 (q/k/v biases, tied embeddings) through `python -m train` and configs/hf_finetune.py."""
  workdir = tmp_path / "qwen"
  # No evaluation: the run above evaluates a model started from Hugging Face weights; this
  # one is about the command line and the config file.
  overrides = [f"--config.{key}={value}" for key, value in {**RUN, "train.eval_batches": 0}.items()]
  ran = subprocess.run(
    [
      sys.executable,
      "-m",
      "train",
      f"--config=configs/hf_finetune.py:{_fixture('qwen2')}",
      f"--workdir={workdir}",
      f"--config.data.data_dir={stdlib_data_dir}",
      *overrides,
    ],
    cwd=ROOT,
    env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert ran.returncode == 0, ran.stderr[-3000:]
  assert "Finished step 2 of 2" in ran.stdout
  _assert_started_from_the_hf_weights(str(workdir), "qwen2")


def test_another_model_config_is_one_line_naming_the_keys_and_the_config_file(stdlib_data_dir, tmp_path):
  config = _config(tiny, tmp_path / "tiny", stdlib_data_dir, **TINY_RUN_SETTINGS)
  with config.unlocked():
    config.train.init_from = _fixture("llama3")
  with pytest.raises(ConfigMismatchError) as error:
    train(config)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"train.init_from={_fixture('llama3')} is a Hugging Face model with another model config (")
  assert "model.d_model" not in message and "model.n_layers: 2 -> 1" in message
  assert "model.vocab_size: 96 -> 384" in message and "model.rope_theta: 500000.0 -> 10000.0" in message
  assert f"pass --config=configs/hf_finetune.py:{_fixture('llama3')}" in message
  assert not os.path.exists(os.path.join(config.workdir, "config.json"))


@pytest.mark.parametrize("tokenizer", ["byte", "tokenizer.json", "llama3"])
def test_another_tokenizer_is_one_line_naming_the_directory(tokenizer, stdlib_data_dir, tmp_path):
  # The directory's tokenizer.json alone lacks the special ids of its config.json: the directory it
  # is. The byte tokenizer's vocabulary would not fit the model: the tokenizer is named first.
  setting = {"tokenizer.json": os.path.join(_fixture("qwen2"), "tokenizer.json"), "llama3": _fixture("llama3")}
  config = _config(hf_finetune, tmp_path / "other", stdlib_data_dir, _fixture("qwen2"), **RUN)
  with config.unlocked():
    config.data.tokenizer = setting.get(tokenizer, tokenizer)
  with pytest.raises(ConfigMismatchError) as error:
    train(config)
  assert str(error.value) == (
    f"data.tokenizer {config.data.tokenizer} differs from the tokenizer of train.init_from={_fixture('qwen2')} "
    f"({_fixture('qwen2')}); pass --config.data.tokenizer={_fixture('qwen2')} to fine-tune that model "
    "(its tokenizer.json)"
  )
  assert not os.path.exists(config.workdir)


def test_the_run_picks_dtypes_and_kernels_and_may_name_the_directory_relatively(monkeypatch):
  model = dict(finetune_model_settings(_fixture("qwen2")), dtype="bfloat16", param_dtype="bfloat16", remat=True)
  check_init_from(_fixture("qwen2"), _as_config(model), _fixture("qwen2"))
  monkeypatch.chdir(FIXTURES)
  check_init_from("qwen2", _as_config(model), "qwen2")  # relative paths of the same directory
  with pytest.raises(ConfigMismatchError, match=r"model.qkv_bias: True -> False"):
    check_init_from(_fixture("qwen2"), _as_config({**model, "qkv_bias": False}), _fixture("qwen2"))


def test_a_derived_field_left_at_zero_is_the_value_it_derives():
  # head_dim=0 means d_model // n_heads: 32 // 4 = 8, the directory's head_dim.
  model = dict(finetune_model_settings(_fixture("qwen2")), head_dim=0)
  check_init_from(_fixture("qwen2"), _as_config(model), _fixture("qwen2"))
  with pytest.raises(ConfigMismatchError, match=r"model.head_dim: 8 -> 16"):
    check_init_from(_fixture("qwen2"), _as_config({**model, "head_dim": 16}), _fixture("qwen2"))
  with pytest.raises(ConfigMismatchError, match=r"model.n_kv_heads: 2 -> 4"):  # 0: one per query head
    check_init_from(_fixture("qwen2"), _as_config({**model, "n_kv_heads": 0}), _fixture("qwen2"))


def _as_config(model):
  from train.config import model_defaults

  config = model_defaults()
  for key, value in model.items():
    config[key] = value
  return config
