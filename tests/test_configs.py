"""Every experiment file in configs/ builds, and the passkey configs produce batches."""

import copy
import importlib
import pathlib

import numpy as np
import pytest

from castle_jax.config import ModelConfig
from castle_jax.data.passkey_data import check_passkey_config
from castle_jax.data.pipeline import make_lm_iterator
from castle_jax.data.tokenizer import load_tokenizer
from castle_jax.models import count_parameters
from train.config import validate_keys
from train.run_checks import validate_train_config

CONFIGS = sorted(
  p.stem for p in (pathlib.Path(__file__).resolve().parent.parent / "configs").glob("*.py") if p.stem != "__init__"
)
PASSKEY_CONFIGS = [name for name in CONFIGS if name.endswith("_passkey")]
# <base>_passkey fine-tunes configs/<base>.py (a run of <base> is its train.init_from).
FINE_TUNE_CONFIGS = [name for name in PASSKEY_CONFIGS if name.removesuffix("_passkey") in CONFIGS]
# The argument a config file takes after its name (--config=configs/<name>.py:<argument>).
ARGUMENTS = {"hf_finetune": str(pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen2")}
# Parameter counts stated in the files' docstrings.
PARAMETERS = {"drt_128m": 146_011_392, "drt_128m_x2": 146_012_160, "swa_128m": 123_587_328}


def _config(name):
  return importlib.import_module(f"configs.{name}").get_config(*([ARGUMENTS[name]] if name in ARGUMENTS else []))


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds(name):
  c = _config(name)
  assert c.is_locked, f"configs/{name}.py must return finalize(config)"
  validate_keys(c)
  validate_train_config(c)
  model_config = ModelConfig.from_mapping(c.model)
  assert model_config.vocab_size >= load_tokenizer(c.data.tokenizer).vocab_size
  if name in PARAMETERS:
    assert count_parameters(model_config) == PARAMETERS[name]


def test_128m_configs_share_the_recipe():
  drt, drt2, swa = (_config(n) for n in ("drt_128m", "drt_128m_x2", "swa_128m"))
  assert drt.model.family == drt2.model.family == "drt" and swa.model.family == "transformer"
  assert drt.model.family_kwargs.retrieval_groups == 1 and drt2.model.family_kwargs.retrieval_groups == 2
  for c in (drt2, swa):
    assert c.train == drt.train and c.data == drt.data
    for key in ("n_layers", "d_model", "n_heads", "head_dim", "mlp_hidden", "sliding_window", "attention_kwargs"):
      assert c.model[key] == drt.model[key], key
  assert drt.data.seq_len % drt.model.family_kwargs.chunk_size == 0


def test_passkey_configs_are_found():
  assert {"drt_tiny_passkey", "swa_tiny_passkey", "drt_small_passkey"} <= set(FINE_TUNE_CONFIGS)


@pytest.mark.parametrize("name", FINE_TUNE_CONFIGS)
def test_passkey_configs_fine_tune_their_base_model(name):
  c = _config(name)
  base = _config(name.removesuffix("_passkey"))
  assert c.model == base.model  # a run of the base config can be loaded as is
  assert c.data.task == "passkey" and c.data.passkey.loss == "answer"
  # The answer starts a chunk of the DRT model (the window baseline shares its DRT twin's prompts).
  drt_base = base if base.model.family == "drt" else _config("drt_tiny")
  assert c.data.passkey.align_to == drt_base.model.family_kwargs.chunk_size


@pytest.mark.parametrize("name", PASSKEY_CONFIGS)
def test_passkey_configs_produce_batches(name, stdlib_data_dir):
  c = copy.deepcopy(_config(name))
  c.data.data_dir = stdlib_data_dir
  tokenizer = load_tokenizer(c.data.tokenizer)
  check_passkey_config(c.data, tokenizer)
  it = make_lm_iterator(c.data, tokenizer, split=c.data.train_split, shuffle=True, process_index=0, process_count=1)
  batch = next(it)
  shape = (c.data.batch_size, c.data.seq_len)
  assert batch["inputs"].shape == batch["targets"].shape == shape
  assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
  assert ((batch["targets"] != tokenizer.pad_id).sum(axis=1) == c.data.passkey.digits).all()
