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

Output normalization: the authors' training code applies a LayerNorm over each head's
attention output (one scale and bias shared by the heads) before W_O; the paper does not
mention it (its FLA-based models normalize the output too). `output_norm="layernorm"`
adds it; the default (None) leaves the output as the paper's formula gives it.

Options (`model.attention_kwargs`, `PowerOptions`):
  p: even power (default 2);
  chunk_size: tokens per chunk of the chunked form (default None: the implementation's own;
    for the Triton kernels the whole context while the attention form costs fewer FLOPs,
    else 1024; 128 for XLA; `castle_jax.ops.power.resolve` decides);
  expansion: "spow" (default), "tpow" or "tspow" (state size D: C(d+p-1, p), d^p, or
    C(d/d_tile+p-1, p) d_tile^p);
  d_tile: tile size of "tspow";
  scale: score scale (default 1/sqrt(head_dim); it cancels in the normalized output and
    only sets the magnitude of the numbers);
  gating: learn per-head gates (default True); False drops W_g and never forgets;
  gate_bias: the constant added before log_sigmoid (default None: 6.906768);
  output_norm: None (default) or "layernorm" (see Output normalization above);
  kernel_config: the Triton kernels' tiles, "block_t=64,block_q=64,..."
    (`PowerTritonConfig` fields) or None for the default.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.layers.options import (
  AttentionOptions,
  check_positive_int,
  kernel_config_option,
  option_error,
  reject_sliding_window,
)
from castle_jax.layers.norms import LayerNorm
from castle_jax.layers.shared import mean_visible_keys, output_projection, projection, rotary_qkv
from castle_jax.ops.power import EXPANSIONS, PowerCache, append_tokens, expanded_dim, init_cache, power_attention
from castle_jax.ops.power.api import KERNEL_CONFIGS, resolve
from castle_jax.ops.power.common import resolve_scale, validate_power
from castle_jax.ops.power.expansion import validate_expansion
from castle_jax.sharding import constrain
from pallas_kernels.power import PowerTritonConfig

if TYPE_CHECKING:  # layers read the config's attributes only; castle_jax.config imports the attention table
  from castle_jax.config import ModelConfig

# log(0.999 / 0.001): the gate is 0.999 at initialization (authors' training code).
DEFAULT_GATE_BIAS = 6.906768
OUTPUT_NORMS = (None, "layernorm")


def _checked(name: str, check):
  """check(), with its ValueError prefixed by the option's config path."""
  try:
    return check()
  except ValueError as error:
    raise ValueError(f"model.attention_kwargs.{name}: {error}") from None


@dataclasses.dataclass(frozen=True)
class PowerOptions(AttentionOptions):
  """Options of `power` (see the module docstring). After `for_model`, d_tile and scale
  are resolved for the model's head dim."""

  p: int = 2
  chunk_size: int | None = None
  expansion: str = "spow"
  d_tile: int | None = None
  scale: float | None = None
  gating: bool = True
  gate_bias: float | None = None
  output_norm: str | None = None
  kernel_config: PowerTritonConfig | str | None = None

  def __post_init__(self):
    _checked("p", lambda: validate_power(self.p))
    check_positive_int("chunk_size", self.chunk_size, allow_none=True)
    if self.expansion not in EXPANSIONS:
      raise option_error("expansion", f"must be one of {EXPANSIONS}, got {self.expansion!r}")
    if not isinstance(self.gating, bool):
      raise option_error("gating", f"must be True or False, got {self.gating!r}")
    if self.gate_bias is not None and (
      isinstance(self.gate_bias, bool) or not isinstance(self.gate_bias, numbers.Real)
    ):
      raise option_error("gate_bias", f"must be a float, got {self.gate_bias!r}")
    if self.gate_bias is not None and not self.gating:
      raise ValueError("model.attention_kwargs.gate_bias has no effect with gating=False; drop one of them")
    if self.output_norm not in OUTPUT_NORMS:
      raise option_error("output_norm", f"must be one of {OUTPUT_NORMS}, got {self.output_norm!r}")

  @property
  def bias(self) -> float:
    return DEFAULT_GATE_BIAS if self.gate_bias is None else float(self.gate_bias)

  def for_model(self, config: ModelConfig) -> "PowerOptions":
    head_dim = config.qk_head_dim
    d_tile = _checked("d_tile", lambda: validate_expansion(self.expansion, head_dim, self.p, self.d_tile))
    scale = _checked("scale", lambda: resolve_scale(self.scale, head_dim))
    reject_sliding_window(
      config, "power attention keeps a state of every key. Set it to 0 (gates decide what is forgotten)"
    )
    # A string from a config file becomes the kernel config of model.attention_impl once, here.
    kernel_config = kernel_config_option("kernel_config", self.kernel_config, KERNEL_CONFIGS, config.attention_impl)
    return dataclasses.replace(self, d_tile=d_tile, scale=scale, kernel_config=kernel_config)


def state_size(config: ModelConfig) -> int:
  """Numbers in one layer's decoding state per sequence: kv_heads * D * (head_dim + 1)."""
  options = config.options
  dim = expanded_dim(config.qk_head_dim, options.p, options.expansion, options.d_tile)
  return config.kv_heads * dim * (config.qk_head_dim + 1)


def cache_for(config: ModelConfig, batch: int, capacity: int) -> PowerCache:
  del capacity  # the state has the same size after any number of tokens
  options = config.options
  return init_cache(
    batch, config.kv_heads, config.qk_head_dim, p=options.p, expansion=options.expansion, d_tile=options.d_tile
  )


def param_count(config: ModelConfig) -> int:
  head_dim = config.qk_head_dim
  projections = 2 * config.d_model * (config.n_heads + config.kv_heads) * head_dim
  gate = config.d_model * config.kv_heads if config.options.gating else 0
  output_norm = 2 * head_dim if config.options.output_norm else 0
  return projections + gate + output_norm


def training_chunk_size(config: ModelConfig, seq_len: int) -> int:
  """The chunk the training path runs for seq_len tokens: `castle_jax.ops.power.resolve`
  for the model's head dims, dtype, options and model.attention_impl (the same call the op
  makes), at most seq_len."""
  options = config.options
  _, chunk_size = resolve(
    config.attention_impl,
    options.chunk_size,
    seq_len=seq_len,
    p=options.p,
    head_dim=config.qk_head_dim,
    value_dim=config.qk_head_dim,
    dtype=config.compute_dtype,
    kernel_config=options.kernel_config,
  )
  return min(chunk_size, seq_len)


def core_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Forward + backward (3x forward) FLOPs per token of the form that runs.

  Per token, with D the expanded dimension and c the chunk size that runs (at most
  seq_len): per k/v head the state update phi(k) v^T and the normalizer sum (2 D d + 2 D);
  per query head the query state phi(q) S and phi(q) . z (2 D d + 2 D) and the
  intra-chunk attention over (c + 1) / 2 keys on average (2 d per q . k and per p . v).
  A sequence of one chunk (the attention form) has no state terms. The expansions
  themselves (p - 1 multiplies per entry) are not counted.
  """
  options = config.options
  head_dim = config.qk_head_dim
  chunk = training_chunk_size(config, seq_len)
  dim = expanded_dim(head_dim, options.p, options.expansion, options.d_tile)
  state = 2 * dim * head_dim + 2 * dim if chunk < seq_len else 0
  in_chunk = 2 * 2 * head_dim * mean_visible_keys(chunk, None)
  return 3 * (config.kv_heads * state + config.n_heads * (state + in_chunk))


class PowerAttention(nn.Module):
  """Gated multi-head power attention.

  Training (cache=None) runs `castle_jax.ops.power.power_attention` (implementation from
  model.attention_impl). With a `PowerCache`, the tokens are appended at positions
  cache.length..: one token is a recurrent step, several run the op's chunked form
  from the cached state, with the same implementation choice as training
  (`castle_jax.ops.power.append_tokens`); either way the cache keeps its size.
  """

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, cache: PowerCache | None = None):
    """x: [batch, seq, d_model], positions: int [batch, seq] -> ([batch, seq, d_model], cache)."""
    cfg = self.config
    options = cfg.options
    q, k, v = rotary_qkv(cfg, x, positions)
    log_g = None
    if options.gating:
      gate_logits = projection(cfg.kv_heads, ("embed", "kv_heads"), cfg.init_std, cfg, "gate")(x)
      # Gates are summed over the whole context: keep them in float32 even under bf16.
      log_g = jax.nn.log_sigmoid(gate_logits.astype(jnp.float32) + options.bias)
      log_g = constrain(log_g, ("batch", "act_length", "act_kv_heads"))
    op_options = dict(
      p=options.p,
      scale=options.scale,
      chunk_size=options.chunk_size,
      expansion=options.expansion,
      d_tile=options.d_tile,
      implementation=cfg.attention_impl,
      kernel_config=options.kernel_config,
    )
    if cache is None:
      out = power_attention(q, k, v, log_g, **op_options)
    else:
      out, cache = append_tokens(cache, q, k, v, log_g, **op_options)
    if options.output_norm == "layernorm":
      out = LayerNorm(dtype=cfg.compute_dtype, param_dtype=cfg.weights_dtype, name="output_norm")(out)
    return output_projection(cfg, out), cache
