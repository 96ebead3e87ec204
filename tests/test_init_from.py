"""train.init_from: a fresh run starts from another run's parameters (fresh optimizer
state and step), a resumed run ignores it, and mismatches fail before anything is written."""

import copy
import json
import os

import jax
import optax
import pytest

from castle_jax.workdir import TOKENIZER_NAME
from train.metrics import read_metrics
from train.trainer import train
from train.resume_checks import ConfigMismatchError, check_init_from


@pytest.fixture()
def source(finished_tiny_run):
  """A finished 8-step run with an eval at its last step (only read: init_from copies
  its parameters)."""
  return finished_tiny_run.config, finished_tiny_run.result


def _fine_tune(source_config, workdir, **train_values):
  config = copy.deepcopy(source_config)
  with config.unlocked():
    config.workdir = str(workdir)
    config.train.init_from = source_config.workdir
    config.train.steps, config.train.eval_every = 4, 1
    for key, value in train_values.items():
      config.train[key] = value
  return config


def _adam_count(opt_state):
  counts = [
    s.count
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    if isinstance(s, optax.ScaleByAdamState)
  ]
  assert len(counts) == 1
  return int(counts[0])


def test_a_fresh_run_starts_from_the_source_parameters_and_a_resume_ignores_init_from(source, tmp_path, capfd):
  source_config, source_result = source
  config = _fine_tune(source_config, tmp_path / "fine")
  result = train(config)
  err = capfd.readouterr().err
  assert f"Initialised the parameters from step 8 of {source_config.workdir} (train.init_from)" in err
  metrics = os.path.join(config.workdir, "metrics.jsonl")
  # The schedule starts at step 0 (learning rate 0), so the parameters after step 1 are the
  # source's: the first eval equals the source's last one.
  evals = read_metrics(metrics, split="eval")
  assert evals[1]["loss"] == pytest.approx(source_result.last_eval_metrics["loss"], rel=1e-6)
  assert read_metrics(metrics)[1]["learning_rate"] == 0.0
  assert read_metrics(metrics, split="init_from")[0]["source_step"] == 8
  assert _adam_count(result.state.opt_state) == 4 and int(result.state.step) == 4
  assert json.load(open(os.path.join(config.workdir, "config.json")))["train"]["init_from"] == source_config.workdir

  with config.unlocked():
    config.train.steps, config.train.allow_schedule_change = 6, True
  train(config)
  err = capfd.readouterr().err
  assert "Resumed from step 4" in err and "train.init_from=" in err and "is ignored" in err
  assert "Initialised the parameters" not in err


def test_a_different_model_or_a_missing_source_is_an_error_before_anything_is_written(source, tmp_path):
  source_config, _ = source
  config = _fine_tune(source_config, tmp_path / "wider")
  with config.unlocked():
    config.model.d_model, config.model.n_heads = 64, 4
  with pytest.raises(ConfigMismatchError) as error:
    train(config)
  message = str(error.value)
  assert "\n" not in message and "model.d_model: 32 -> 64" in message and "model.n_heads: 2 -> 4" in message
  assert f"train.init_from={source_config.workdir}" in message
  assert not os.path.exists(os.path.join(config.workdir, "config.json"))

  config = _fine_tune(source_config, tmp_path / "orphan", init_from=str(tmp_path / "nowhere"))
  with pytest.raises(
    FileNotFoundError,
    match=r"nowhere/config.json not found: train.init_from=.* must be a "
    r"training workdir \(written by `python -m train`",
  ):
    train(config)


def test_a_different_tokenizer_is_an_error(tmp_path, tiny_run_config):
  source = tmp_path / "bpe_run"
  source.mkdir()
  (source / TOKENIZER_NAME).write_text("{}")
  saved = json.loads(tiny_run_config.to_json())
  saved["data"]["tokenizer"] = TOKENIZER_NAME
  (source / "config.json").write_text(json.dumps(saved))
  with pytest.raises(ConfigMismatchError, match="data.tokenizer byte differs from the tokenizer of train.init_from"):
    check_init_from(str(source), tiny_run_config.model, "byte")
  check_init_from(str(source), tiny_run_config.model, str(source / TOKENIZER_NAME))  # the same file: fine


def test_a_drt_run_may_start_from_one_that_retrieved_other_chunks(tmp_path):
  """DRT's top_k, gumbel and retriever choose which chunks are read, not the parameters: a
  sharper top-k (or the random-retriever control) may fine-tune a run that read every
  chunk; a chunk size may not."""
  from configs.drt_tiny_retrieval import get_config

  source_config = get_config()
  (tmp_path / "config.json").write_text(source_config.to_json())
  config = get_config()
  config.model.family_kwargs = dict(config.model.family_kwargs, top_k=4, gumbel=False)
  check_init_from(str(tmp_path), config.model, "byte")
  config.model.family_kwargs = dict(config.model.family_kwargs, retriever="random")
  check_init_from(str(tmp_path), config.model, "byte")
  config.model.family_kwargs = dict(config.model.family_kwargs, chunk_size=15)
  with pytest.raises(ConfigMismatchError, match=r"model.family_kwargs.chunk_size: 31 -> 15"):
    check_init_from(str(tmp_path), config.model, "byte")
