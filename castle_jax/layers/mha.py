"""Standard causal multi-head attention (`mha`): optional grouped-query heads and
sliding window, RoPE on queries and keys."""

from __future__ import annotations

import flax.linen as nn
import jax

from castle_jax.inference.kv_cache import KVCache
from castle_jax.layers.linear import Linear
from castle_jax.layers.registry import register_attention
from castle_jax.layers.rope import apply_rope
from castle_jax.models.config import ModelConfig
from castle_jax.ops.attention import causal_attention, causal_mask, masked_attention
from castle_jax.sharding import constrain


def _mha_cache(config: ModelConfig, batch: int, capacity: int) -> KVCache:
  return KVCache.create(batch, capacity, config.kv_heads, config.qk_head_dim, config.compute_dtype)


def _mha_params(config: ModelConfig) -> int:
  q_and_out = 2 * config.d_model * config.n_heads * config.qk_head_dim
  return q_and_out + 2 * config.d_model * config.kv_heads * config.qk_head_dim


def mean_visible_keys(seq_len: int, window: int | None) -> float:
  """Average number of keys a causal query sees over positions 0..seq_len-1."""
  if window is None or window >= seq_len:
    return (seq_len + 1) / 2
  # Positions < window see i+1 keys, the rest see `window`.
  return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def _mha_core_flops(config: ModelConfig, seq_len: int) -> float:
  # q.k and p.v: 2 matmuls x 2 FLOPs per multiply-add, x3 for forward + backward.
  return 12 * config.n_heads * config.qk_head_dim * mean_visible_keys(seq_len, config.window)


def projection(features, axes, std, config: ModelConfig, name: str, contract_dims: int = 1) -> Linear:
  """A bias-free projection in the model's dtypes whose kernel carries logical axis names."""
  return Linear(tuple(features) if isinstance(features, tuple) else (features,), axes, contract_dims, std,
                config.compute_dtype, config.weights_dtype, name=name)


def rotary_qkv(config: ModelConfig, x: jax.Array, positions: jax.Array):
  """Projections "query", "key", "value" of x: [batch, seq, d_model], RoPE on q and k.

  Must be called inside a module's compact method (the projections become its
  submodules). Returns q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads,
  head_dim], with logical-axis constraints.
  """
  heads, kv_heads, head_dim = config.n_heads, config.kv_heads, config.qk_head_dim
  q = projection((heads, head_dim), ("embed", "heads", "head_dim"), config.init_std, config, "query")(x)
  k = projection((kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), config.init_std, config, "key")(x)
  v = projection((kv_heads, head_dim), ("embed", "kv_heads", "head_dim"), config.init_std, config, "value")(x)
  q = constrain(apply_rope(q, positions, config.rope_theta), ("batch", "act_length", "act_heads", "head_dim"))
  k = constrain(apply_rope(k, positions, config.rope_theta), ("batch", "act_length", "act_kv_heads", "head_dim"))
  return q, k, constrain(v, ("batch", "act_length", "act_kv_heads", "head_dim"))


def output_projection(config: ModelConfig, out: jax.Array) -> jax.Array:
  """W^O ("out"): attention output [batch, seq, heads, head_dim] -> [batch, seq, d_model].

  Must be called inside a module's compact method.
  """
  out = constrain(out, ("batch", "act_length", "act_heads", "head_dim"))
  return projection(config.d_model, ("heads", "head_dim", "embed"), config.out_init_std, config, "out",
                    contract_dims=2)(out)


@register_attention("mha", init_cache=_mha_cache, param_count=_mha_params, core_flops_per_token=_mha_core_flops)
class MultiHeadAttention(nn.Module):
  """Causal softmax attention.

  Training (cache=None) goes through `castle_jax.ops.attention.causal_attention`
  (cuDNN on GPU); decoding attends new queries to a `KVCache` with a
  position-based mask, so one step or a whole prompt can be appended.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, cache: KVCache | None = None):
    """x: [batch, seq, d_model], positions: int [batch, seq] -> ([batch, seq, d_model], cache)."""
    cfg = self.config
    q, k, v = rotary_qkv(cfg, x, positions)
    if cache is None:
      out = causal_attention(q, k, v, window=cfg.window, implementation=cfg.attention_impl)
    else:
      cache = cache.append(k, v)
      mask = causal_mask(positions, cache.key_positions(), cfg.window)
      out = masked_attention(q, cache.keys, cache.values, mask)
    return output_projection(cfg, out), cache
