"""Pieces every attention layer uses: projections in the model's dtypes, RoPE'd
queries/keys/values, the output projection W^O, and the average number of keys a
causal query sees (for FLOP counts).

The projection helpers create submodules, so they must be called inside a module's
compact method; the parameter names they take ("query", "key", "value", "out", ...)
are the checkpoint's parameter paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from castle_jax.layers.linear import Linear
from castle_jax.layers.rope import apply_rope
from castle_jax.sharding import constrain

if TYPE_CHECKING:  # layers read the config's attributes only; castle_jax.config imports the attention table
  from castle_jax.config import ModelConfig


def mean_visible_keys(seq_len: int, window: int | None) -> float:
  """Average number of keys a causal query sees over positions 0..seq_len-1."""
  if window is None or window >= seq_len:
    return (seq_len + 1) / 2
  # Positions < window see i+1 keys, the rest see `window`.
  return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def projection(
  features, axes, std, config: ModelConfig, name: str, contract_dims: int = 1, use_bias: bool = False
) -> Linear:
  """A projection in the model's dtypes (bias-free unless `use_bias`) whose kernel carries logical axis names."""
  return Linear(
    tuple(features) if isinstance(features, tuple) else (features,),
    axes,
    contract_dims,
    std,
    config.compute_dtype,
    config.weights_dtype,
    use_bias,
    name=name,
  )


def rotary_qkv(config: ModelConfig, x: jax.Array, positions: jax.Array, *, rope: bool = True):
  """Projections "query", "key", "value" of x: [batch, seq, d_model] (with biases when
  model.qkv_bias), RoPE on q and k (unless `rope` is False: positions then enter as
  biases, e.g. ALiBi), its frequencies scaled as model.rope_scaling says.

  Returns q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim],
  with logical-axis constraints.
  """
  heads, kv_heads, head_dim = config.n_heads, config.kv_heads, config.qk_head_dim
  bias = config.qkv_bias
  q = projection((heads, head_dim), ("embed", "heads", "head_dim"), config.init_std, config, "query", use_bias=bias)(x)
  k = projection(
    (kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), config.init_std, config, "key", use_bias=bias
  )(x)
  v = projection(
    (kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), config.init_std, config, "value", use_bias=bias
  )(x)
  if rope:
    theta, scaling = config.rope_theta, config.rope_scaling
    q, k = apply_rope(q, positions, theta, scaling), apply_rope(k, positions, theta, scaling)
  q = constrain(q, ("batch", "act_length", "act_heads", "head_dim"))
  k = constrain(k, ("batch", "act_length", "act_kv_heads", "head_dim"))
  return q, k, constrain(v, ("batch", "act_length", "act_kv_heads", "head_dim"))


def output_projection(config: ModelConfig, out: jax.Array) -> jax.Array:
  """W^O ("out"): attention output [batch, seq, heads, head_dim] -> [batch, seq, d_model]."""
  out = constrain(out, ("batch", "act_length", "act_heads", "head_dim"))
  return projection(
    config.d_model, ("heads", "head_dim", "embed"), config.out_init_std, config, "out", contract_dims=2
  )(out)
