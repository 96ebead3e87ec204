"""The attention registry: config name -> module class plus what the rest of the
system needs to know about it (cache layout, parameter count, FLOPs).

A module registered here is called as
  `module(config=model_config, name="attention")(x, positions, cache)`
with x: [batch, seq, d_model], positions: int [batch, seq], cache: the pytree made
by `init_cache` or None (training), and returns (y: [batch, seq, d_model], cache).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn

from castle_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """A registered attention and its bookkeeping.

  Attributes:
    name: the config name (`model.attention`).
    module: the Flax module class.
    init_cache: (config, batch, capacity) -> cache pytree for incremental decoding.
    param_count: config -> number of parameters of one attention layer.
    core_flops_per_token: (config, seq_len) -> training FLOPs (forward + backward)
      per token of one layer's attention core, excluding the projections, which
      the 6N term of the model FLOPs already counts.
  """

  name: str
  module: type[nn.Module]
  init_cache: Callable[[ModelConfig, int, int], Any]
  param_count: Callable[[ModelConfig], int]
  core_flops_per_token: Callable[[ModelConfig, int], float]


_REGISTRY: dict[str, AttentionKind] = {}


def register_attention(name: str, *, init_cache, param_count, core_flops_per_token):
  """Class decorator adding a module to the registry under `name`."""

  def decorate(module_cls):
    if name in _REGISTRY:
      raise ValueError(f"attention {name!r} is already registered")
    _REGISTRY[name] = AttentionKind(name, module_cls, init_cache, param_count, core_flops_per_token)
    return module_cls

  return decorate


def get_attention(name: str) -> AttentionKind:
  """Looks up a registered attention, with an error listing the known names."""
  _import_builtin_attentions()
  if name not in _REGISTRY:
    raise ValueError(f"Unknown attention {name!r} (config model.attention); registered: {sorted(_REGISTRY)}")
  return _REGISTRY[name]


def registered_attentions() -> tuple[str, ...]:
  _import_builtin_attentions()
  return tuple(sorted(_REGISTRY))


def _import_builtin_attentions() -> None:
  # Imported lazily: the modules import this registry to register themselves.
  from castle_jax.layers import castle, mha, power  # noqa: F401
