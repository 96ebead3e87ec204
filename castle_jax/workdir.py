"""Reading a trained workdir: its config, tokenizer and the parameters of a checkpoint.

A workdir written by `python -m train` holds `config.json` (the run's whole config;
data.tokenizer relative to the workdir), `tokenizer.json` for a BPE run, and
`checkpoints/<step>/` (Orbax steps verified by a checksum manifest, see
`castle_jax.checkpoints`). Evaluation (`castle_jax.eval`), sampling and fine-tuning
from another run (`train.init_from`) read it through this module; only the trainer
writes it.

    model, params, tokenizer, step = load_trained_model("runs/tiny")
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import ml_collections

from castle_jax.checkpoints import Checkpointer
from castle_jax.data.tokenizer import Tokenizer, load_tokenizer
from castle_jax.models import ModelConfig, build_model, family_of

CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
CHECKPOINTS_DIR = "checkpoints"


class TrainedModel(NamedTuple):
  """What `load_trained_model` returns (a tuple: `model, params, tokenizer, step = ...`)."""

  model: nn.Module
  params: Any
  tokenizer: Tokenizer
  step: int


def saved_config(workdir: str) -> dict[str, Any] | None:
  """The workdir's config.json as a dict, or None when there is none."""
  path = os.path.join(workdir, CONFIG_NAME)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def read_config(workdir: str, *, what: str = "--workdir") -> ml_collections.ConfigDict:
  """The config a workdir was trained with; FileNotFoundError naming `what` (the
  flag or key that gave the workdir) when it has no config.json."""
  config = saved_config(os.path.abspath(workdir))
  if config is None:
    raise FileNotFoundError(f"{os.path.join(os.path.abspath(workdir), CONFIG_NAME)} not found: {what} must be a "
                            "directory written by `python -m train`")
  return ml_collections.ConfigDict(config)


def resolve_tokenizer_path(workdir: str, tokenizer: str) -> str:
  """data.tokenizer from a saved config.json: relative paths are relative to the
  workdir (older workdirs stored them relative to where training ran)."""
  if tokenizer == "byte" or os.path.isabs(tokenizer):
    return tokenizer
  inside = os.path.join(workdir, tokenizer)
  return inside if os.path.exists(inside) else tokenizer


def abstract_params(model: nn.Module, seq_len: int, device: jax.Device | None = None) -> Any:
  """The model's parameters as ShapeDtypeStructs placed on one device (default: the
  first), from `jax.eval_shape` of its family's init: nothing is computed."""
  sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
  boxed = jax.eval_shape(lambda rng: family_of(model).init_variables(model, rng, seq_len)["params"],
                         jax.random.key(0))
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)

  def place(leaf):
    value = leaf.unbox(apply_constraint=False) if is_box(leaf) else leaf
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

  return jax.tree.map(place, boxed, is_leaf=is_box)


def restore_params(workdir: str, abstract: Any, *, step: int | None = None, log=None,
                   what: str = "--workdir") -> tuple[Any, int]:
  """(params, step) of a workdir's checkpoint, restored into the shardings of
  `abstract` (a tree of ShapeDtypeStructs; the optimizer state is not read).

  step None: the newest step that verifies against its manifest and reads (a
  damaged newer one is reported and skipped, nothing is moved or deleted).

  Raises:
    FileNotFoundError: the workdir has no checkpoints.
    ValueError: `step` has no checkpoint (the message lists the available ones).
    CheckpointError: the step (or every step) is damaged.
  """
  checkpointer = Checkpointer(os.path.join(os.path.abspath(workdir), CHECKPOINTS_DIR), read_only=True)
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise FileNotFoundError(f"No checkpoints in {checkpointer.directory} ({what})")
    if step is not None and step not in steps:
      raise ValueError(f"No checkpoint for step {step} in {checkpointer.directory}; available: {steps}")
    return checkpointer.restore_newest_params(abstract, step=step, log=log)
  finally:
    checkpointer.close()


def load_trained_model(workdir: str, step: int | None = None, *, log=None) -> TrainedModel:
  """(model, params, tokenizer, step) from a training workdir.

  Reads `<workdir>/config.json` and restores only the parameters (not the
  optimizer state) of the newest good checkpoint, or of `step`, after checking it
  against its checksum manifest, onto one device. The tokenizer is the workdir's.
  `log` receives warnings (default: stderr).
  """
  workdir = os.path.abspath(workdir)
  config = read_config(workdir)
  model = build_model(ModelConfig.from_mapping(config.model))
  params, step = restore_params(workdir, abstract_params(model, config.data.seq_len), step=step, log=log)
  return TrainedModel(model, params, load_workdir_tokenizer(workdir, config), step)


def load_workdir_tokenizer(workdir: str, config: ml_collections.ConfigDict | None = None) -> Tokenizer:
  """The tokenizer a workdir was trained with (its own copy of a BPE file)."""
  config = read_config(workdir) if config is None else config
  return load_tokenizer(resolve_tokenizer_path(os.path.abspath(workdir), config.data.tokenizer))

