"""Does a new config fit the run it continues, or the run it starts from?

Checked before any checkpoint is read: a `model.*` value that differs from the workdir's
saved config.json (`check_model_unchanged`), another tokenizer file
(`check_tokenizer_unchanged`), another learning-rate schedule (`check_schedule_unchanged`), another number of data
worker processes (`check_data_workers_unchanged`);
for `train.init_from`, the source run's (or Hugging Face model directory's) model and
tokenizer (`check_init_from`). Each mismatch is one line listing what differs.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from castle_jax.checkpoints import file_sha256
from castle_jax.config import COMPUTATION_FIELDS
from castle_jax.models import ModelConfig, family_of
from castle_jax.models.hf import RUN_CHOICES, is_hf_model_dir
from castle_jax.workdir import TOKENIZER_NAME, read_config, resolve_tokenizer_path, saved_config
from train.config import base_config

_SCHEDULE_KEYS = ("steps", "learning_rate", "warmup_steps", "min_lr_ratio")


class ConfigMismatchError(ValueError):
  """The new config's model differs from the one the workdir's checkpoints were trained with."""


def _flat(mapping: Mapping[str, Any], prefix: str) -> dict[str, Any]:
  out = {}
  for key, value in mapping.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _derived_fields_resolved(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[dict, dict]:
  """`saved` and `current` (model sections) with each derived field they set differently
  (`ModelConfig.derived_fields`: 0 means "derive it") replaced on both sides by the value it
  derives, so that `head_dim=0` and the head_dim it means are one model. Fields both set
  alike stay as they are (a changed n_heads is one difference, not three); both sections stay
  as they are if one is not a valid ModelConfig (e.g. a section of an older schema)."""
  try:
    derived = [ModelConfig.from_mapping(saved).derived_fields(), ModelConfig.from_mapping(current).derived_fields()]
  except (TypeError, ValueError):
    return dict(saved), dict(current)
  differing = [field for field in derived[0] if saved.get(field) != current.get(field)]
  return tuple(
    {**model, **{field: values[field] for field in differing}} for model, values in zip((saved, current), derived)
  )


def model_differences(saved_model: Mapping[str, Any], model_config) -> list[str]:
  """`model.key: old -> new` for every key where a saved config.json's model section
  differs from `model_config` (a ConfigDict).

  A key the saved config lacks (added to the schema after that run) counts as
  unchanged when the new value is the schema default, which by convention keeps
  the old behaviour. A derived field set to 0 equals the value it derives."""
  saved, current = _derived_fields_resolved(saved_model, json.loads(model_config.to_json_best_effort()))
  old = _flat(saved, "model.")
  new = _flat(current, "model.")
  defaults = _flat(json.loads(base_config().model.to_json_best_effort()), "model.")
  unset = "<unset>"
  differing = []
  for key in sorted(set(old) | set(new)):
    before = old.get(key, defaults.get(key, unset))
    after = new.get(key, unset)
    if before != after:
      differing.append(f"{key}: {before!r} -> {after!r}")
  return differing


def _except_fields(differing: list[str], fields) -> list[str]:
  """The `model.key: old -> new` lines of `model_differences` whose key is not model.<field>
  for a field of `fields`."""
  keys = {f"model.{field}" for field in fields}
  return [line for line in differing if line.split(":")[0] not in keys]


def check_model_unchanged(workdir: str, model_config) -> None:
  """Raises ConfigMismatchError (one line listing `model.key: old -> new`) when the
  workdir's saved config.json has a different model (see `model_differences`); the
  attention implementation and rematerialization (`COMPUTATION_FIELDS`) may change."""
  saved = saved_config(workdir)
  if saved is None or "model" not in saved:
    return
  differing = _except_fields(model_differences(saved["model"], model_config), COMPUTATION_FIELDS)
  if differing:
    raise ConfigMismatchError(
      f"The checkpoints in {workdir} were trained with another model config ({'; '.join(differing)}). "
      "Restore those values to resume, or start over in a new --workdir (or with "
      "--config.train.resume=False --config.train.overwrite=True)."
    )


def check_init_from(source: str, model_config, tokenizer: str) -> None:
  """`train.init_from`: the source workdir must hold a run (config.json) with the
  same model config and the same tokenizer as this one; or be a Hugging Face model
  directory whose model is this config's (`hf.finetune_model_settings`: all but the
  `hf.RUN_CHOICES`, dtypes and kernels, which the run picks) and whose tokenizer is
  data.tokenizer (the directory itself).

  Raises:
    FileNotFoundError: `source` has no config.json.
    ConfigMismatchError: one line listing the differing model.* keys, or naming the tokenizers.
    ValueError: `source` is a Hugging Face model directory of an unsupported model.
  """
  source = os.path.abspath(source)
  what = f"train.init_from={source}"
  saved = read_config(source, what=what).to_dict()
  differing = model_differences(saved.get("model", {}), model_config)
  if is_hf_model_dir(source):
    differing = _except_fields(differing, RUN_CHOICES)
    if differing:
      raise ConfigMismatchError(
        f"{what} is a Hugging Face model with another model config ({'; '.join(differing)}): pass "
        f"--config=configs/hf_finetune.py:{source}, which takes the model.* values and data.tokenizer from it, "
        "or set those values"
      )
    check_same_tokenizer(source, tokenizer, what=what, fix="to fine-tune that model (its tokenizer.json)")
    return
  training_only = family_of(ModelConfig.from_mapping(model_config)).training_only_kwargs
  differing = [
    line for line in differing if not any(line.startswith(f"model.family_kwargs.{key}:") for key in training_only)
  ]
  if differing:
    raise ConfigMismatchError(
      f"{what} was trained with another model config ({'; '.join(differing)}): "
      "its parameters only fit the same model.* values; set them, or init from another run"
    )
  check_same_tokenizer(source, tokenizer, what=what, fix="to fine-tune from that run")


def check_same_tokenizer(source: str, tokenizer: str, *, what: str, fix: str = "") -> None:
  """The run in `source` (a workdir, or a Hugging Face model directory: its own tokenizer) must
  have used `tokenizer` (data.tokenizer): the same setting, the same Hugging Face model
  directory, or a BPE file with the same contents. ConfigMismatchError names `what`."""
  saved = read_config(source, what=what).to_dict()
  theirs = resolve_tokenizer_path(source, saved["data"]["tokenizer"])
  both = "byte" not in (theirs, tokenizer)
  same = (
    theirs == tokenizer
    or (both and os.path.isdir(theirs) and os.path.isdir(tokenizer) and os.path.samefile(theirs, tokenizer))
    or (both and os.path.isfile(theirs) and os.path.isfile(tokenizer) and file_sha256(theirs) == file_sha256(tokenizer))
  )
  if not same:
    raise ConfigMismatchError(
      f"data.tokenizer {tokenizer} differs from the tokenizer of {what} ({theirs}); "
      f"pass --config.data.tokenizer={theirs}" + (f" {fix}" if fix else "")
    )


def check_tokenizer_unchanged(workdir: str, tokenizer: str) -> None:
  """A resumed BPE run must use the tokenizer file it was trained with."""
  copy = os.path.join(workdir, TOKENIZER_NAME)
  if tokenizer == "byte" or not os.path.isfile(copy) or not os.path.isfile(tokenizer):
    return
  if os.path.abspath(tokenizer) != os.path.abspath(copy) and file_sha256(tokenizer) != file_sha256(copy):
    raise ConfigMismatchError(
      f"data.tokenizer {tokenizer} differs from the tokenizer the checkpoints in {workdir} were trained "
      f"with ({copy}); pass --config.data.tokenizer={copy} to resume, or start over in a new --workdir"
    )


def check_schedule_unchanged(saved: Mapping[str, Any] | None, config, workdir: str) -> list[str]:
  """The LR-schedule settings that differ from the run being resumed ("key: old -> new").

  Raises ValueError unless `train.allow_schedule_change`; with it, returns them
  so the caller can warn."""
  if not saved or "train" not in saved:
    return []
  differing = [
    f"train.{k}: {saved['train'].get(k)!r} -> {config.train[k]!r}"
    for k in _SCHEDULE_KEYS
    if k in saved["train"] and saved["train"][k] != config.train[k]
  ]
  if differing and not config.train.allow_schedule_change:
    raise ValueError(
      f"Resuming the run in {workdir} with a different learning-rate schedule ({'; '.join(differing)}): "
      "the warm-up/cosine schedule would be rebuilt and the learning rate would jump at the resumed "
      "step. Pass --config.train.allow_schedule_change=True to do it anyway, or keep the old values."
    )
  return differing


def check_data_workers_unchanged(saved: Mapping[str, Any] | None, config, workdir: str) -> None:
  """Raises ValueError when `data.worker_count` differs from the run being resumed: grain
  saves the stream's position per worker process, so it restores with the same count only."""
  if not saved or "data" not in saved:
    return
  before = saved["data"].get("worker_count", 0)
  after = config.data.worker_count
  if before != after:
    raise ValueError(
      f"Resuming the run in {workdir} with data.worker_count {before} -> {after}: the saved position in the "
      f"data stream is kept per worker process and restores with the same count only; pass "
      f"--config.data.worker_count={before}"
    )
