"""Parsing `model.family_kwargs` into a family's options dataclass."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from castle_jax.config import ModelConfig

Options = TypeVar("Options")


def parse_family_options(cls: type[Options], config: ModelConfig, family: str) -> Options:
  """config.family_kwargs as `cls` (a dataclass whose __post_init__ checks the values);
  unknown keys are errors that list the known ones."""
  kwargs = dict(config.family_kwargs)
  known = [field.name for field in dataclasses.fields(cls)]
  unknown = sorted(set(kwargs) - set(known))
  if unknown:
    raise ValueError(f"Unknown model.family_kwargs {unknown} for model family {family!r}; known: {known}")
  return cls(**kwargs)
