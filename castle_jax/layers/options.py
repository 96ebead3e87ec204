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


def kernel_config_option(name: str, value, config_types: Mapping[str, type], implementation: str | None):
  """The kernel config of the implementation that runs, from a "key=value,..." option string
  (or the config itself, or None).

  Args:
    name: the option's name (`model.attention_kwargs.<name>`).
    value: None, a config, or a string of its fields.
    config_types: {implementation: its kernel config class} (the op's KERNEL_CONFIGS).
    implementation: model.attention_impl; None leaves the choice to the op, which then needs
      a config type that only one implementation takes.
  """
  if value is None:
    return None
  kinds = ", ".join(f"{impl!r}: {cls.__name__}" for impl, cls in config_types.items())
  if implementation in config_types:
    config_type = config_types[implementation]
  elif implementation is None and len(set(config_types.values())) == 1:
    (config_type,) = set(config_types.values())
  elif implementation is None:
    raise option_error(
      name, f"needs model.attention_impl set to one of {tuple(config_types)}, whose config it is ({kinds})"
    )
  else:
    raise option_error(
      name, f"configures the kernels ({kinds}); model.attention_impl={implementation!r} takes none: drop it"
    )
  if isinstance(value, config_type):
    return value
  if not isinstance(value, str):
    raise option_error(name, f'must be a "key=value,..." string of {config_type.__name__} fields, got {value!r}')
  try:
    return config_type.from_string(value)
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
