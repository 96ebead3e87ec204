"""Standard causal multi-head attention (`mha`): optional grouped-query heads and
sliding window (model.sliding_window), RoPE on queries and keys, or ALiBi biases
instead (`model.attention_kwargs.positions = "alibi"`, with a sliding window: the
GCA paper's baseline and DRT's self-attention)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import flax.linen as nn
import jax

from castle_jax.layers.options import AttentionOptions, option_error
from castle_jax.layers.shared import mean_visible_keys, output_projection, rotary_qkv
from castle_jax.ops.attention import KVCache, causal_attention, causal_mask, masked_attention
from castle_jax.ops.attention.alibi import alibi_bias
from castle_jax.ops.tree_attention import cache_attention, tree_attention

if TYPE_CHECKING:  # layers read the config's attributes only; castle_jax.config imports the attention table
  from castle_jax.config import ModelConfig


POSITIONS = ("rope", "alibi")


class TreeVerification(NamedTuple):
  """How new tokens see each other when a target verifies a drafted tree.

  Attributes:
    mask: bool [batch, n, n]: token i sees token j (its ancestors and itself).
    implementation: of `castle_jax.ops.tree_attention.tree_attention` (None: the default).
  """

  mask: jax.Array
  implementation: str | None = None


class PendingKV(NamedTuple):
  """Keys and values [batch, n, kv_heads, head_dim] of verified tokens, not yet in the cache."""

  keys: jax.Array
  values: jax.Array


@dataclasses.dataclass(frozen=True)
class MhaOptions(AttentionOptions):
  """Options of `mha` (its window is model.sliding_window).

  Attributes:
    positions: "rope" (rotary embeddings on q and k) or "alibi" (no rotation; scores
      biased by -m_h (i - j), m_h = 2^(-8 (h + 1) / heads); needs model.sliding_window).
  """

  positions: str = "rope"

  def __post_init__(self):
    if self.positions not in POSITIONS:
      raise option_error("positions", f"must be one of {POSITIONS}, got {self.positions!r}")

  def for_model(self, config: ModelConfig) -> "MhaOptions":
    if self.positions == "alibi" and not config.sliding_window:
      raise ValueError(
        "model.attention_kwargs.positions='alibi' runs as sliding-window attention: set "
        "model.sliding_window (the GCA paper uses 512)"
      )
    return self


def cache_for(config: ModelConfig, batch: int, capacity: int) -> KVCache:
  return KVCache.create(batch, capacity, config.kv_heads, config.qk_head_dim, config.compute_dtype)


def param_count(config: ModelConfig) -> int:
  q_and_out = 2 * config.d_model * config.n_heads * config.qk_head_dim
  biases = (config.n_heads + 2 * config.kv_heads) * config.qk_head_dim if config.qkv_bias else 0
  return q_and_out + 2 * config.d_model * config.kv_heads * config.qk_head_dim + biases


def core_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  # q.k and p.v: 2 matmuls x 2 FLOPs per multiply-add, x3 for forward + backward.
  return 12 * config.n_heads * config.qk_head_dim * mean_visible_keys(seq_len, config.window)


class MultiHeadAttention(nn.Module):
  """Causal softmax attention.

  Training (cache=None) goes through `castle_jax.ops.attention.causal_attention`
  (cuDNN on GPU); decoding attends new queries to a `KVCache` with a
  position-based mask, so one step or a whole prompt can be appended; a single new
  token under full causal RoPE attention goes through `cache_attention` (flash decoding
  over the filled slots: the Pallas kernel on a GPU).
  """

  config: ModelConfig

  @nn.compact
  def __call__(
    self, x: jax.Array, positions: jax.Array, cache: KVCache | None = None, tree: TreeVerification | None = None
  ):
    """x: [batch, seq, d_model], positions: int [batch, seq] -> ([batch, seq, d_model], cache).

    Training (no cache) also sows the layer's rotated (keys, values) [batch, seq, kv_heads,
    head_dim] as intermediates "keys_values" (read by a LongSpec draft; free unless the
    "intermediates" collection is mutable).

    tree: with a cache, verify drafted tree nodes (speculative decoding): the seq new tokens
    attend to every filled cache slot and, among themselves, as `tree.mask` allows; the
    cache is left unchanged and the second result is the tokens' `PendingKV`, to be
    committed (`KVCache.append`) for the accepted ones.
    """
    cfg = self.config
    alibi = cfg.options.positions == "alibi"
    q, k, v = rotary_qkv(cfg, x, positions, rope=not alibi)
    if cache is None:
      if tree is not None:
        raise ValueError("tree is a decoding argument: training attention is causal (pass a cache to verify a tree)")
      self.sow("intermediates", "keys_values", (k, v))
      out = causal_attention(q, k, v, window=cfg.window, alibi=alibi, implementation=cfg.attention_impl)
      return output_projection(cfg, out), cache
    if tree is not None:
      if alibi or cfg.window:
        raise ValueError(
          "tree verification needs full causal attention with RoPE (no model.sliding_window, positions='rope')"
        )
      out = tree_attention(
        q, cache.keys, cache.values, cache.length, k, v, tree.mask, implementation=tree.implementation
      )
      return output_projection(cfg, out), PendingKV(k, v)
    cache = cache.append(k, v)
    if x.shape[1] == 1 and not alibi and not cfg.window:
      # One token under full causal attention sees exactly the filled slots: flash decoding
      # over them (the Pallas kernel on a GPU) reads the filled part of the cache once,
      # where the masked form below reads and scores the whole capacity.
      out, _ = cache_attention(q, cache.keys, cache.values, cache.length)
      return output_projection(cfg, out), cache
    visible = causal_mask(positions, cache.key_positions(), cfg.window)
    bias = alibi_bias(positions, cache.key_positions(), cfg.n_heads) if alibi else None
    out = masked_attention(q, cache.keys, cache.values, visible, bias)
    return output_projection(cfg, out), cache
