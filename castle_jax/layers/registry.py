"""The attention table: one explicit entry per `model.attention` name, with the layer
module, its typed options, the op's implementations and what the rest of the system
needs to know about it (cache layout, parameter count, FLOPs).

A module listed here is called as
  `module(config=model_config, name="attention")(x, positions, cache)`
with x: [batch, seq, d_model], positions: int [batch, seq], cache: the pytree made
by `init_cache` or None (training), and returns (y: [batch, seq, d_model], cache).

To add an attention: write its layer module (module class, options dataclass,
cache_for, param_count, core_flops_per_token) and add one entry to ATTENTIONS.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import flax.linen as nn

from castle_jax.layers import castle, mha, power
from castle_jax.layers.options import AttentionOptions
from castle_jax.ops import attention as attention_op
from castle_jax.ops import castle as castle_op
from castle_jax.ops import power as power_op

if TYPE_CHECKING:  # castle_jax.config imports this table to check configs
  from castle_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """One attention and its bookkeeping.

  Attributes:
    name: the config name (`model.attention`).
    module: the Flax module class.
    options: the options dataclass `model.attention_kwargs` is parsed into.
    implementations: the names `model.attention_impl` may take (the op's).
    init_cache: (config, batch, capacity) -> cache pytree for incremental decoding.
    param_count: config -> number of parameters of one attention layer.
    core_flops_per_token: (config, seq_len) -> training FLOPs (forward + backward)
      per token of one layer's attention core, excluding the projections, which
      the 6N term of the model FLOPs already counts.
  """

  name: str
  module: type[nn.Module]
  options: type[AttentionOptions]
  implementations: tuple[str, ...]
  init_cache: Callable[[ModelConfig, int, int], Any]
  param_count: Callable[[ModelConfig], int]
  core_flops_per_token: Callable[[ModelConfig, int], float]


def _kind(name, layer, module, options, op) -> AttentionKind:
  return AttentionKind(
    name, module, options, op.IMPLEMENTATIONS, layer.cache_for, layer.param_count, layer.core_flops_per_token
  )


ATTENTIONS: dict[str, AttentionKind] = {
  "mha": _kind("mha", mha, mha.MultiHeadAttention, mha.MhaOptions, attention_op),
  "castle": _kind("castle", castle, castle.MultiHeadCastle, castle.CastleOptions, castle_op),
  # CASTLE-SWL is CASTLE's module; its options require the lookahead window.
  "castle_swl": _kind("castle_swl", castle, castle.MultiHeadCastle, castle.CastleSWLOptions, castle_op),
  "power": _kind("power", power, power.PowerAttention, power.PowerOptions, power_op),
}


def get_attention(name: str) -> AttentionKind:
  """Looks up an attention, with an error listing the known names."""
  if name not in ATTENTIONS:
    raise ValueError(f"Unknown attention {name!r} (config model.attention); registered: {sorted(ATTENTIONS)}")
  return ATTENTIONS[name]


def registered_attentions() -> tuple[str, ...]:
  return tuple(sorted(ATTENTIONS))
