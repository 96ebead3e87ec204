"""Rebuilding a trained model from its workdir, for sampling and evaluation scripts."""

from __future__ import annotations

import json
import os

import jax
import ml_collections
import optax

from castle_jax.data.tokenizer import load_tokenizer
from castle_jax.models import ModelConfig, build_model
from train.checkpointing import Checkpointer
from train.mesh import make_mesh
from train.state import state_shardings
from train.workdir import CONFIG_NAME, resolve_tokenizer_path


def load_trained_model(workdir: str, step: int | None = None):
  """(model, params, tokenizer, step) from a training workdir.

  Reads `<workdir>/config.json`, and restores only the parameters (not the
  optimizer state) of the latest checkpoint, or of `step`, after checking it
  against its checksum manifest. The tokenizer file is the workdir's copy.
  """
  workdir = os.path.abspath(workdir)
  config_path = os.path.join(workdir, CONFIG_NAME)
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{config_path} not found: --workdir must be a directory written by `python -m train`")
  with open(config_path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise FileNotFoundError(f"No checkpoints in {checkpointer.directory}")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise ValueError(f"No checkpoint for step {step} in {checkpointer.directory}; available: {steps}")
    model = build_model(ModelConfig.from_mapping(config.model))
    mesh = make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)), jax.devices()[:1])
    # optax.identity() has no state: only the parameters' shapes and shardings are built.
    abstract, _ = state_shardings(model, optax.identity(), mesh, config.data.seq_len)
    params = checkpointer.restore_params(step, abstract.params)
  finally:
    checkpointer.close()
  tokenizer = load_tokenizer(resolve_tokenizer_path(workdir, config.data.tokenizer))
  return model, params, tokenizer, step
