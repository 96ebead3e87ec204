"""Multi-head power attention (`power`): gated (q . k)^p attention with a constant-size state.

Projections: bias-free W_Q [d_model, heads, head_dim], W_K, W_V [d_model, kv_heads,
head_dim] (grouped-query heads when model.n_kv_heads < n_heads), W_O, and the gate
W_g [d_model, kv_heads] (one gate per k/v head, since a k/v head's state is shared by
its query group):
  log g_t = log_sigmoid(x_t W_g + gate_bias),
as in the per-head gating the paper adopts from Lin et al. (2025). The paper prints no
bias; the authors' training code adds the constant 6.906768 (g = 0.999 at init, so a
fresh model starts with long memory instead of halving the past at every token), and
so does this layer by default (`gate_bias`; 0 gives the bare log_sigmoid(x W_g)).

Positions: RoPE on queries and keys, as in the transformers the paper swaps its
attention into (it changes only the attention layer) and in the authors' training
code. The rotation is applied before the expansion, so prefill, decoding and training
see the same rotated vectors and agree exactly.

The authors' training code also applies a per-head LayerNorm to the attention output;
the paper does not mention it, and it is not used here.

Options (`model.attention_kwargs`):
  p: even power (default 2);
  chunk_size: tokens per chunk of the chunked form (default None: the implementation's own,
    1024 for the Pallas kernels, 128 for XLA);
  expansion: "spow" (default), "tpow" or "tspow" (state size D: C(d+p-1, p), d^p, or
    C(d/d_tile+p-1, p) d_tile^p);
  d_tile: tile size of "tspow";
  scale: score scale (default 1/sqrt(head_dim); it cancels in the normalized output and
    only sets the magnitude of the numbers);
  gating: learn per-head gates (default True); False drops W_g and never forgets;
  gate_bias: the constant added before log_sigmoid (default 6.906768).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.layers.mha import mean_visible_keys, output_projection, projection, rotary_qkv
from castle_jax.layers.registry import register_attention
from castle_jax.models.config import ModelConfig
from castle_jax.ops.power import (
    DEFAULT_CHUNK_SIZE,
    EXPANSIONS,
    PowerCache,
    append_tokens,
    expanded_dim,
    init_cache,
    power_attention,
)
from castle_jax.ops.power.api import PALLAS_DEFAULT_CHUNK_SIZE
from castle_jax.ops.power.common import resolve_scale, validate_power
from castle_jax.ops.power.expansion import validate_expansion
from castle_jax.sharding import constrain

# log(0.999 / 0.001): the gate is 0.999 at initialization (authors' training code).
DEFAULT_GATE_BIAS = 6.906768


class PowerOptions(NamedTuple):
  p: int
  chunk_size: int | None
  expansion: str
  d_tile: int | None
  scale: float
  gating: bool
  gate_bias: float


def power_options(config: ModelConfig) -> PowerOptions:
  """The validated `model.attention_kwargs` of a `power` config (see module docstring).

  Raises:
    ValueError: unknown options, bad values (naming model.attention_kwargs.<name>), or a
      causal sliding window (not part of power attention).
  """
  options = config.attention_options
  unknown = sorted(set(options) - set(PowerOptions._fields))
  if unknown:
    raise ValueError(f"Unknown model.attention_kwargs {unknown} for attention {config.attention!r}; "
                     f"known: {list(PowerOptions._fields)}")
  head_dim = config.qk_head_dim

  def checked(name, check):
    try:
      return check()
    except ValueError as error:
      raise ValueError(f"model.attention_kwargs.{name}: {error}") from None

  p = checked("p", lambda: validate_power(options.get("p", 2)))
  chunk_size = options.get("chunk_size")
  if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                 or chunk_size < 1):
    raise ValueError(f"model.attention_kwargs.chunk_size must be None or an int >= 1, got {chunk_size!r}")
  expansion = options.get("expansion", "spow")
  if expansion not in EXPANSIONS:
    raise ValueError(f"model.attention_kwargs.expansion must be one of {EXPANSIONS}, got {expansion!r}")
  d_tile = checked("d_tile", lambda: validate_expansion(expansion, head_dim, p, options.get("d_tile")))
  scale = checked("scale", lambda: resolve_scale(options.get("scale"), head_dim))
  gating = options.get("gating", True)
  if not isinstance(gating, bool):
    raise ValueError(f"model.attention_kwargs.gating must be True or False, got {gating!r}")
  gate_bias = options.get("gate_bias", DEFAULT_GATE_BIAS)
  if isinstance(gate_bias, bool) or not isinstance(gate_bias, numbers.Real):
    raise ValueError(f"model.attention_kwargs.gate_bias must be a float, got {gate_bias!r}")
  if "gate_bias" in options and not gating:
    raise ValueError("model.attention_kwargs.gate_bias has no effect with gating=False; drop one of them")
  if config.sliding_window:
    raise ValueError("model.sliding_window limits the keys of 'mha'; power attention keeps a state of every key. "
                     "Set it to 0 (gates decide what is forgotten)")
  chunk_size = None if chunk_size is None else int(chunk_size)
  return PowerOptions(p, chunk_size, expansion, d_tile, scale, gating, float(gate_bias))


def state_size(config: ModelConfig) -> int:
  """Numbers in one layer's decoding state per sequence: kv_heads * D * (head_dim + 1)."""
  options = power_options(config)
  dim = expanded_dim(config.qk_head_dim, options.p, options.expansion, options.d_tile)
  return config.kv_heads * dim * (config.qk_head_dim + 1)


def _power_cache(config: ModelConfig, batch: int, capacity: int) -> PowerCache:
  del capacity  # the state has the same size after any number of tokens
  options = power_options(config)
  return init_cache(batch, config.kv_heads, config.qk_head_dim, p=options.p, expansion=options.expansion,
                    d_tile=options.d_tile)


def _power_params(config: ModelConfig) -> int:
  head_dim = config.qk_head_dim
  projections = 2 * config.d_model * (config.n_heads + config.kv_heads) * head_dim
  gate = config.d_model * config.kv_heads if power_options(config).gating else 0
  return projections + gate


def _chunk_size(config: ModelConfig) -> int:
  """The chunk the training path uses: the configured one, else the implementation's default."""
  chunk_size = power_options(config).chunk_size
  if chunk_size is not None:
    return chunk_size
  on_kernels = config.attention_impl == "pallas" or (config.attention_impl is None and jax.default_backend() == "gpu")
  return PALLAS_DEFAULT_CHUNK_SIZE if on_kernels else DEFAULT_CHUNK_SIZE


def _power_core_flops(config: ModelConfig, seq_len: int) -> float:
  """Forward + backward (3x forward) FLOPs per token of the chunked form.

  Per token, with D the expanded dimension and c the chunk size (at most seq_len):
  per k/v head the state update phi(k) v^T and the normalizer sum (2 D d + 2 D); per
  query head the query state phi(q) S and phi(q) . z (2 D d + 2 D) and the intra-chunk
  attention over (c + 1) / 2 keys on average (2 d per q . k and per p . v). The
  expansions themselves (p - 1 multiplies per entry) are not counted.
  """
  options = power_options(config)
  head_dim = config.qk_head_dim
  dim = expanded_dim(head_dim, options.p, options.expansion, options.d_tile)
  state = 2 * dim * head_dim + 2 * dim
  in_chunk = 2 * 2 * head_dim * mean_visible_keys(min(_chunk_size(config), seq_len), None)
  return 3 * (config.kv_heads * state + config.n_heads * (state + in_chunk))


@register_attention("power", init_cache=_power_cache, param_count=_power_params,
                    core_flops_per_token=_power_core_flops)
class PowerAttention(nn.Module):
  """Gated multi-head power attention.

  Training (cache=None) runs `castle_jax.ops.power.power_attention` (implementation from
  model.attention_impl). With a `PowerCache`, the tokens are appended at positions
  cache.length..: one token is a recurrent step, several run the chunked form from the
  cached state (`castle_jax.ops.power.append_tokens`); either way the cache keeps its size.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, cache: PowerCache | None = None):
    """x: [batch, seq, d_model], positions: int [batch, seq] -> ([batch, seq, d_model], cache)."""
    cfg = self.config
    options = power_options(cfg)
    q, k, v = rotary_qkv(cfg, x, positions)
    log_g = None
    if options.gating:
      gate_logits = projection(cfg.kv_heads, ("embed", "kv_heads"), cfg.init_std, cfg, "gate")(x)
      # Gates are summed over the whole context: keep them in float32 even under bf16.
      log_g = jax.nn.log_sigmoid(gate_logits.astype(jnp.float32) + options.gate_bias)
      log_g = constrain(log_g, ("batch", "act_length", "act_kv_heads"))
    op_options = dict(p=options.p, scale=options.scale, chunk_size=options.chunk_size,
                      expansion=options.expansion, d_tile=options.d_tile)
    if cache is None:
      out = power_attention(q, k, v, log_g, implementation=cfg.attention_impl, **op_options)
    else:
      out, cache = append_tokens(cache, q, k, v, log_g, **op_options)
    return output_projection(cfg, out), cache
