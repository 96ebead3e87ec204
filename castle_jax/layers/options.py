"""Typed attention options: the base class of each attention's `model.attention_kwargs`.

Each attention declares a frozen dataclass of its options (`MhaOptions`,
`CastleOptions`, `PowerOptions`, in the attention's layer module). `from_kwargs`
builds it from the config's free-form mapping, so an unknown key is an error naming
`model.attention_kwargs.<key>` and the known keys; each class checks its values in
`__post_init__` and, in `for_model`, what depends on the model's other fields (head
dim, grouped-query heads, sliding window).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # the options read the config's attributes only; castle_jax.config imports the attention table
  from castle_jax.config import ModelConfig


def option_error(name: str, problem: str) -> ValueError:
  """A ValueError that names the option as a config path."""
  return ValueError(f"model.attention_kwargs.{name} {problem}")


def check_positive_int(name: str, value, *, allow_none: bool = False) -> None:
  """Raises unless value is an int >= 1 (or None when allow_none)."""
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise option_error(name, f"must be {'None or ' if allow_none else ''}an int >= 1, got {value!r}")


def kernel_config_option(name: str, value, config_class):
  """A kernel config dataclass from a "key=value,..." option string (or the config itself, or None)."""
  if value is None or isinstance(value, config_class):
    return value
  if not isinstance(value, str):
    raise option_error(name, f"must be a \"key=value,...\" string of {config_class.__name__} fields, got {value!r}")
  try:
    return config_class.from_string(value)
  except ValueError as error:
    raise ValueError(f"model.attention_kwargs.{name}: {value!r}: {error}") from None


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
  """Options of one attention (no fields here; subclasses add theirs)."""

  @classmethod
  def from_kwargs(cls, kwargs: Mapping[str, Any], attention: str) -> "AttentionOptions":
    """cls(**kwargs), with unknown keys reported as config paths next to the known ones."""
    known = [field.name for field in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
      raise ValueError(f"Unknown model.attention_kwargs {unknown} for attention {attention!r}; known: {known}")
    return cls(**kwargs)

  def for_model(self, config: ModelConfig) -> "AttentionOptions":
    """These options checked against (and resolved for) the rest of the model config."""
    del config
    return self


def reject_sliding_window(config: ModelConfig, why: str) -> None:
  """model.sliding_window belongs to 'mha'; other attentions say why they have none."""
  if config.sliding_window:
    raise ValueError(f"model.sliding_window limits the keys of 'mha'; {why}")
