"""Rebuilding a trained model from its workdir, for sampling and evaluation scripts."""

from __future__ import annotations

import json
import os

import jax
import ml_collections

from castle_jax.data.tokenizer import load_tokenizer
from castle_jax.models import ModelConfig, build_model
from train.checkpointing import Checkpointer
from train.mesh import make_mesh
from train.optimizer import make_optimizer
from train.state import state_shardings


def load_trained_model(workdir: str, step: int | None = None):
  """(model, params, tokenizer, step) from a training workdir."""
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{config_path} not found: --workdir must be a directory written by `python -m train`")
  with open(config_path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), keep=max(1, config.train.keep_checkpoints))
  steps = checkpointer.all_steps()
  if not steps:
    raise FileNotFoundError(f"No checkpoints in {checkpointer.directory}")
  step = steps[-1] if step is None else step
  if step not in steps:
    raise ValueError(f"No checkpoint for step {step} in {checkpointer.directory}; available: {steps}")
  model = build_model(ModelConfig.from_mapping(config.model))
  tx, _ = make_optimizer(config.train)
  mesh = make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)), jax.devices()[:1])
  abstract, _ = state_shardings(model, tx, mesh, config.data.seq_len)
  state = checkpointer.restore(step, abstract)
  checkpointer.close()
  return model, state.params, load_tokenizer(config.data.tokenizer), step
