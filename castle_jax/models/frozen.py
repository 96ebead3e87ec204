"""Where a model family's frozen parameters come from (a LongSpec draft's target)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from castle_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class FrozenSource:
  """Parameters a family's loss reads but training never changes, from another run.

  Attributes:
    name: their key in the parameter tree the loss sees (`{**params, name: frozen}`).
    workdir: the run's training workdir, or a Hugging Face model directory.
    step: its checkpoint step (None: the newest good one).
    setting: the config key that names the workdir, for messages.
    model_config: the ModelConfig to restore them with.
    differences: (the run's saved ModelConfig) -> one line per field where it does not
      fit `model_config` (empty: it fits).
    adopt: (the source's ModelConfig) -> the family's config with every field that must
      fit the source taken from it (used when the source is a Hugging Face model
      directory, whose config.json no config file mirrors).
    step_setting: the config key that names `step`, for messages.
  """

  name: str
  workdir: str
  step: int | None
  setting: str
  model_config: ModelConfig
  differences: Callable[[ModelConfig], list[str]]
  adopt: Callable[[ModelConfig], ModelConfig]
  step_setting: str
