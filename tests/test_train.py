"""End-to-end training on a tiny corpus: loss falls, exact resume, divergence, checkpoints."""

import copy
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from helpers import Interrupt
from castle_jax.workdir import load_trained_model
from train.config import finalize, validate_keys
from train.metrics import read_metrics
from train.trainer import TrainingDivergedError, train
from castle_jax.inference import generate


@pytest.fixture()
def config(tiny_run_config):
  with tiny_run_config.unlocked():
    tiny_run_config.train.eval_batches = 1
  return tiny_run_config


def _losses(workdir):
  return {s: r["loss"] for s, r in read_metrics(os.path.join(workdir, "metrics.jsonl")).items()}


def test_loss_decreases_and_metrics_are_written(config):
  with config.unlocked():
    config.train.steps, config.train.eval_every = 40, 40
  result = train(config)
  losses = _losses(config.workdir)
  assert np.mean([losses[s] for s in range(36, 41)]) < losses[1] - 1.0
  assert 0 < result.last_eval_metrics["bits_per_byte"] < 8
  assert result.last_eval_metrics["perplexity"] == pytest.approx(np.exp(result.last_eval_metrics["loss"]))
  evals = read_metrics(os.path.join(config.workdir, "metrics.jsonl"), split="eval")
  assert list(evals) == [40]
  records = read_metrics(os.path.join(config.workdir, "metrics.jsonl"))
  assert all(0 <= r["data_wait_s"] < 60 for r in records.values())  # input wait per step, seconds
  assert os.listdir(os.path.join(config.workdir, "tensorboard"))
  assert json.load(open(os.path.join(config.workdir, "config.json")))["model"]["d_model"] == 32


@pytest.mark.parametrize("prefetch", [2])
def test_interrupted_run_resumes_with_the_same_loss_curve(config, finished_tiny_run, prefetch):
  # A background thread reads batches ahead; the checkpointed iterator state is
  # still the position of the batches the steps consumed.
  with config.unlocked():
    config.data.prefetch = prefetch
  # The uninterrupted run of this config (the same settings, trained once for the suite).
  assert config.to_dict() == {**finished_tiny_run.config.to_dict(), "workdir": config.workdir}
  expected = finished_tiny_run.losses

  def interrupt_at_6(step):
    if step == 6:
      raise Interrupt()

  with pytest.raises(Interrupt):
    train(config, after_step=interrupt_at_6)
  result = train(config)  # resumes from the step-4 checkpoint, same data order
  resumed = _losses(config.workdir)
  assert sorted(resumed) == list(range(1, 9))
  for step in range(1, 9):
    assert resumed[step] == expected[step], step  # bit-for-bit
  # Steps 5 and 6 ran twice; metrics.jsonl holds each once, the first run's moved aside.
  records = [json.loads(line) for line in open(os.path.join(config.workdir, "metrics.jsonl"))]
  assert len({(r["split"], r["step"]) for r in records}) == len(records)
  aside = [json.loads(line) for line in open(os.path.join(config.workdir, "metrics_set_aside.jsonl"))]
  assert [(r["split"], r["step"]) for r in aside] == [("train", 5), ("train", 6)]
  assert int(result.state.step) == 8
  # The training time runs on from the resumed step's (eval time left out).
  elapsed = {(r["split"], r["step"]): r["elapsed_s"] for r in records}
  train_elapsed = [elapsed["train", step] for step in range(1, 9)]
  assert train_elapsed == sorted(train_elapsed) and train_elapsed[0] > 0
  assert elapsed["train", 4] <= elapsed["eval", 4] <= elapsed["train", 5]

  # The final checkpoint restores to the final parameters.
  model, params, tokenizer, step = load_trained_model(config.workdir)
  assert step == 8
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(result.state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  prompt = np.asarray([[tokenizer.bos_id, *tokenizer.encode("def ")]], np.int32)
  text = tokenizer.decode(np.asarray(generate(model, params, prompt, max_new_tokens=8)[0]))
  assert text.startswith("def ")


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(config):
  with config.unlocked():
    config.train.steps = 4
  train(config)
  with config.unlocked():
    config.train.steps = 8
    config.train.learning_rate = 1e30  # finite, so accepted; the first update blows the weights up
    config.train.allow_schedule_change = True
  with pytest.raises(
    TrainingDivergedError, match=r"step [56]: .*last good checkpoint is step 4.*resumed from checkpoint step 4"
  ):
    train(config)
  model, params, _, step = load_trained_model(config.workdir)
  assert step == 4
  assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params))


def test_unknown_config_keys_are_rejected(config):
  with config.unlocked():
    config.train.stpes = 10
    config.model.attention_kwargs.anything = 1  # free-form: allowed
  with pytest.raises(ValueError, match=r"Unknown config keys: train.stpes \(did you mean train.steps\?\)"):
    validate_keys(config)
  locked = finalize(copy.deepcopy(tiny.get_config()))
  with pytest.raises(AttributeError):
    locked.train.stpes = 10


@pytest.mark.parametrize(
  "override, match",
  [
    (("data", "batch_size", 7), "data.batch_size"),
    (("train", "grad_accum_steps", 3), "data.batch_size"),
    (("data", "seq_len", 0), "data.seq_len"),
    (("model", "attention", "flash"), "Unknown attention 'flash'"),
    (("model", "vocab_size", 100), "smaller than the tokenizer"),
    (("mesh", "data", 3), "does not divide"),
    (("workdir", None, ""), "workdir"),
    (("train", "log_every", 0), "train.log_every must be >= 1"),
    (("train", "eval_every", -1), "train.eval_every must be >= 0"),
    (("train", "checkpoint_every", -5), "train.checkpoint_every must be >= 0"),
    (("train", "eval_batches", -1), "train.eval_batches must be >= 0"),
    (("train", "learning_rate", -1e-3), "train.learning_rate must be a finite number > 0"),
    (("train", "learning_rate", float("nan")), "train.learning_rate must be a finite number > 0"),
    (("train", "b2", 1.0), r"train.b2 must be in \[0, 1\)"),
    (("train", "eps", 0.0), "train.eps must be"),
    (("train", "weight_decay", -0.1), "train.weight_decay must be"),
    (("train", "grad_clip", 0.0), "train.grad_clip must be"),
    (("train", "min_lr_ratio", 2.0), "train.min_lr_ratio must be"),
    (("train", "steps", 0), "train.steps must be"),
    (("data", "prefetch", -1), "data.prefetch must be"),
    (("train", "overwrite", True), "train.overwrite must be used with train.resume=False"),
  ],
)
def test_bad_run_configs_fail_before_training(config, override, match):
  section, key, value = override
  with config.unlocked():
    if key is None:
      config[section] = value
    else:
      config[section][key] = value
  with pytest.raises(ValueError, match=match):
    train(config)


def test_config_help_lists_every_key_with_its_default():
  from train.config_help import config_help_text

  text = config_help_text()
  for line in (
    "train.learning_rate = 0.0006",
    "train.overwrite = False",
    "train.resume_step = None",
    "data.prefetch = 2",
    "model.d_model = 256",
  ):
    assert line in text


def test_missing_checkpoints_are_reported(tmp_path, config):
  with pytest.raises(FileNotFoundError, match="config.json"):
    load_trained_model(str(tmp_path / "nowhere"))
  os.makedirs(config.workdir)
  with open(os.path.join(config.workdir, "config.json"), "w") as f:
    f.write(config.to_json())
  with pytest.raises(FileNotFoundError, match="No checkpoints"):
    load_trained_model(config.workdir)


def test_eval_step_in_microbatches_sums_the_same():
  import functools
  import jax.numpy as jnp
  from castle_jax.models import ModelConfig, build_model
  from train.step import eval_step

  model = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, dtype="float32"))
  tokens = jax.random.randint(jax.random.key(0), (4, 9), 0, 31).at[3, 5:].set(31)  # 4 PAD targets in one row
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = model.init(jax.random.key(1), batch["inputs"])["params"]
  run = functools.partial(
    eval_step, params, batch, model=model, pad_id=31, token_byte_lengths=jnp.arange(32, dtype=jnp.float32)
  )
  whole, split = jax.jit(run)(), jax.jit(lambda: run(microbatches=2))()
  assert float(whole["tokens"]) == 4 * 8 - 4
  for key in whole:
    np.testing.assert_allclose(split[key], whole[key], rtol=1e-6)


def test_throughput_counts_input_positions_not_scored_targets():
  """With most targets padded (passkey answers), `tokens` counts the scored targets and
  `input_tokens` (what tokens/s and MFU use) every input position."""
  import functools

  import optax
  from castle_jax.models import ModelConfig, build_model
  from train.state import TrainState
  from train.step import train_step

  model = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, dtype="float32"))
  inputs = jax.random.randint(jax.random.key(0), (2, 8), 0, 31)
  targets = jnp.full((2, 8), 31).at[:, -2:].set(3)  # 2 scored targets per row
  params = model.init(jax.random.key(1), inputs)["params"]
  tx = optax.sgd(0.1)
  state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params))
  step = jax.jit(functools.partial(train_step, model=model, tx=tx, schedule=optax.constant_schedule(0.1), pad_id=31))
  _, metrics = step(state, {"inputs": inputs, "targets": targets})
  assert float(metrics["tokens"]) == 4 and float(metrics["input_tokens"]) == 16


def test_a_smoke_run_clips_the_warm_up_and_reports_its_start_and_its_checkpoint(config, capfd):
  """steps < warmup_steps (a short run of a config made for a long one) clips the warm-up
  with a note; the run prints what it runs where first, and the checkpoint it saved last."""
  with config.unlocked():
    config.train.steps, config.train.warmup_steps = 2, 30
  train(config)
  out, err = capfd.readouterr()
  assert "NOTE: train.warmup_steps=30 is more than train.steps=2: the warm-up is clipped to 2 steps" in err
  assert json.load(open(os.path.join(config.workdir, "config.json")))["train"]["warmup_steps"] == 2
  lines = out.strip().splitlines()
  banner = dict(line.split(maxsplit=1) for line in lines[:5])
  assert banner["model"].startswith("transformer (mha attention), 0.") and "M trained parameters" in banner["model"]
  assert banner["devices"] == f"{jax.device_count()} x cpu in 1 process(es); mesh data 8 x fsdp 1 x tensor 1"
  assert banner["workdir"] == config.workdir and banner["start"] == "fresh (random parameters, seed 0)"
  assert banner["schedule"].startswith("2 steps of 8 x 32 tokens, learning rate 0.003 (warm-up 2), log every 1")
  ready = lines[5].split(maxsplit=1)
  assert ready[0] == "ready" and re.fullmatch(
    r"[\d.]+s after the start: model and mesh [\d.]+s, data [\d.]+s, parameters [\d.]+s, other [\d.]+s", ready[1]
  ), lines[5]
  checkpoint = os.path.join(config.workdir, "checkpoints", "2")
  assert lines[-1] == f"Finished step 2 of 2; saved checkpoint {checkpoint}"

  train(config)  # the same command again: nothing to run, the same clipped schedule
  out, _ = capfd.readouterr()
  assert f"start     resumed from step 2 ({checkpoint})" in out
  assert out.strip().splitlines()[-1] == f"Finished step 2 of 2; saved checkpoint {checkpoint}"


def test_a_negative_warm_up_is_an_error(config):
  with config.unlocked():
    config.train.warmup_steps = -1
  with pytest.raises(ValueError, match="train.warmup_steps must be an integer >= 0, got -1"):
    train(config)
