"""Multi-head CASTLE (`castle`) and CASTLE-SWL (`castle_swl`) attention layers.

Each head has six bias-free projections W_Q^U, W_K^U, W_V^U, W_Q^C, W_K^C, W_V^C and
the heads share one output projection W^O: 7 * heads * head_dim * d_model
parameters (paper, Appendix C).

Rotary position embeddings. The paper uses RoPE but does not say where it enters
CASTLE. Here every vector that meets a query in a dot product is rotated by its own
token's position, and nothing else:
  - q^C and k^C: the causal scores q^C_t . k^C_s depend on t - s, as in standard
    attention;
  - q^U and k^U: the lookahead gate sigmoid(q^U_s . k^U_j) depends on j - s, how far
    ahead of token s the token j lies;
  - v^U: the lookahead score q^C_t . u_s^t = sum_j sigmoid(.) q^C_t . v^U_j meets the
    causal query through v^U_j, so rotating v^U_j by j makes it depend on t - j.
v^C is a value and stays unrotated. With this choice all three kinds of score depend
on relative offsets only, and the op's math is untouched: rotated inputs go into
Theorem 1's parallel form, the blockwise path and the UQ-KV cache alike, so training,
prefill and decoding agree exactly (the cache stores rotated q^U and u_s built from
rotated v^U).

Options (`model.attention_kwargs`):
  lookahead_window: W, the CASTLE-SWL window (required for `castle_swl`, rejected
    for `castle`);
  block_size: tokens per block of the blockwise training path (default 64).
"""

from __future__ import annotations

import flax.linen as nn
import jax

from castle_jax.layers.mha import mean_visible_keys, output_projection, projection
from castle_jax.layers.registry import register_attention
from castle_jax.layers.rope import apply_rope
from castle_jax.models.config import ModelConfig
from castle_jax.ops.castle import (
    DEFAULT_BLOCK_SIZE,
    UQKVCache,
    append_tokens,
    castle_attention,
    init_cache,
)
from castle_jax.sharding import constrain

_OPTIONS = ("lookahead_window", "block_size")
_ACTIVATION_AXES = ("batch", "act_length", "act_heads", "head_dim")
# The six per-head projections, in the op's argument order.
_PROJECTIONS = ("lookahead_query", "lookahead_key", "lookahead_value",
                "causal_query", "causal_key", "causal_value")
_ROTATED = frozenset(("lookahead_query", "lookahead_key", "lookahead_value", "causal_query", "causal_key"))


def castle_options(config: ModelConfig) -> tuple[int | None, int]:
  """(lookahead window or None, block size) of a `castle`/`castle_swl` config.

  Raises:
    ValueError: unknown options, a window on `castle` or none on `castle_swl`,
      non-positive values, GQA or a causal sliding window (not part of CASTLE).
  """
  options = config.attention_options
  unknown = sorted(set(options) - set(_OPTIONS))
  if unknown:
    raise ValueError(f"Unknown model.attention_kwargs {unknown} for attention {config.attention!r}; "
                     f"known: {list(_OPTIONS)}")
  window = options.get("lookahead_window")
  swl = config.attention == "castle_swl"
  if swl and window is None:
    raise ValueError("attention 'castle_swl' needs model.attention_kwargs.lookahead_window = W >= 1 "
                     "(the paper uses 128 for S and 512 for M/L/XL)")
  if not swl and window is not None:
    raise ValueError(f"attention {config.attention!r} has no lookahead window; use attention 'castle_swl' "
                     "to slide a window over the lookahead keys")
  block_size = options.get("block_size", DEFAULT_BLOCK_SIZE)
  for name, value in (("lookahead_window", window), ("block_size", block_size)):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
      raise ValueError(f"model.attention_kwargs.{name} must be an int >= 1, got {value!r}")
  if config.n_kv_heads not in (0, config.n_heads):
    raise ValueError(f"CASTLE has no grouped-query form: model.n_kv_heads must be 0 or n_heads "
                     f"({config.n_heads}), got {config.n_kv_heads}")
  if config.sliding_window:
    raise ValueError("model.sliding_window limits causal keys of 'mha'; CASTLE attends to every causal key. "
                     "Set it to 0 (for CASTLE-SWL use attention 'castle_swl' with "
                     "model.attention_kwargs.lookahead_window)")
  return window, block_size


def _castle_cache(config: ModelConfig, batch: int, capacity: int) -> UQKVCache:
  window, _ = castle_options(config)
  return init_cache(batch, capacity, config.n_heads, config.qk_head_dim, config.compute_dtype, window)


def _castle_params(config: ModelConfig) -> int:
  return 7 * config.n_heads * config.qk_head_dim * config.d_model


def _castle_core_flops(config: ModelConfig, seq_len: int) -> float:
  """Forward + backward (3x forward) FLOPs per token of the attention core.

  Per (query t, key s) pair the forward does six d-long products: q^C.k^C, p.v^C and
  the lookahead score's q^C.D (over all causal pairs), and q^U.k^U, the D update and
  q^C.v^U (only within the lookahead window under SWL). The in-block term of the
  blockwise algorithm (block_size-long products) is an implementation cost, not counted.
  """
  window, _ = castle_options(config)
  causal = mean_visible_keys(seq_len, None)
  lookahead = mean_visible_keys(seq_len, window)
  per_head = 2 * config.qk_head_dim * (3 * causal + 3 * lookahead)
  return 3 * config.n_heads * per_head


@register_attention("castle", init_cache=_castle_cache, param_count=_castle_params,
                    core_flops_per_token=_castle_core_flops)
class MultiHeadCastle(nn.Module):
  """Multi-head causal attention with lookahead keys.

  Training (cache=None) goes through `castle_jax.ops.castle.castle_attention`
  (implementation from model.attention_impl). With a `UQKVCache`, the tokens are
  appended at positions cache.length.. (`castle_jax.ops.castle.append_tokens`): a prompt
  into an empty cache is a blockwise prefill (Algorithm 5), anything else runs
  decoding steps (Algorithm 4).
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, cache: UQKVCache | None = None):
    """x: [batch, seq, d_model], positions: int [batch, seq] -> ([batch, seq, d_model], cache)."""
    cfg = self.config
    window, block_size = castle_options(cfg)
    heads, head_dim = cfg.n_heads, cfg.qk_head_dim
    inputs = []
    for name in _PROJECTIONS:
      y = projection((heads, head_dim), ("embed", "heads", "head_dim"), cfg.init_std, cfg, name)(x)
      if name in _ROTATED:
        y = apply_rope(y, positions, cfg.rope_theta)
      inputs.append(constrain(y, _ACTIVATION_AXES))
    if cache is None:
      out = castle_attention(*inputs, window=window, implementation=cfg.attention_impl, block_size=block_size)
    else:
      out, cache = append_tokens(cache, *inputs, block_size=block_size, implementation=cfg.attention_impl)
    return output_projection(cfg, out), cache


@register_attention("castle_swl", init_cache=_castle_cache, param_count=_castle_params,
                    core_flops_per_token=_castle_core_flops)
class MultiHeadCastleSWL(MultiHeadCastle):
  """CASTLE-SWL: lookahead keys see only the next W tokens (Eq. 8); W is
  model.attention_kwargs.lookahead_window."""
