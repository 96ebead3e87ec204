"""Checks shared by the kernels' config dataclasses; each message names the class and the field."""

from __future__ import annotations

import dataclasses

# The smallest block the GPU's matrix units take (a tensor-core tile side).
SMALLEST_TILE = 16


def is_power_of_two(n: int) -> bool:
  return n >= 1 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1): the padded size of a tile of n rows."""
  return 1 << max(0, n - 1).bit_length()


def check_int_fields(config, *, power_of_two: tuple[str, ...], tiles: tuple[str, ...], skip: tuple[str, ...] = ()):
  """Raises ValueError unless every field (but `skip`) is an int >= 1, the `power_of_two`
  fields are powers of two and the `tiles` fields are at least SMALLEST_TILE."""
  kind = type(config).__name__
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.name not in skip and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise ValueError(f"{kind}.{field.name} must be an int >= 1, got {value!r}")
  for name in power_of_two:
    if not is_power_of_two(getattr(config, name)):
      raise ValueError(f"{kind}.{name} must be a power of two, got {getattr(config, name)}")
  for name in tiles:
    if getattr(config, name) < SMALLEST_TILE:
      raise ValueError(
        f"{kind}.{name} must be >= {SMALLEST_TILE} (the smallest tile the GPU's matrix units "
        f"take), got {getattr(config, name)}"
      )


def parse_config(cls, text: str):
  """A kernel config dataclass from "key=value,key=value" (e.g. "block_q=64,num_warps=8").

  Values are ints where they read as ints, None for "none"/"None", else strings; the
  class's own checks then run. One parser for the benchmarks' command lines and the
  `model.attention_kwargs.kernel_config` strings of training configs.

  Raises:
    ValueError: an entry without "=", or a key the class does not have (naming it and
      the known keys); and whatever the class's checks raise.
  """
  known = [field.name for field in dataclasses.fields(cls)]
  values = {}
  for entry in filter(None, (part.strip() for part in text.split(","))):
    key, sep, value = (s.strip() for s in entry.partition("="))
    if not sep:
      raise ValueError(f"{cls.__name__}: {entry!r} is not key=value (in {text!r}); known keys: {known}")
    if key == "backend" and key not in known:
      raise ValueError(
        f"{cls.__name__} has no key 'backend' (in {text!r}): the implementation picks the kernels now, "
        "implementation='triton' or 'mosaic' (model.attention_impl in a config)"
      )
    if key not in known:
      raise ValueError(f"{cls.__name__} has no key {key!r} (in {text!r}); known keys: {known}")
    if value.lower() == "none":
      values[key] = None
    else:
      try:
        values[key] = int(value)
      except ValueError:
        values[key] = value
  return cls(**values)
