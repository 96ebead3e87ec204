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

Options (`model.attention_kwargs`, `CastleOptions`):
  lookahead_window: W, the CASTLE-SWL window (required for `castle_swl`, rejected
    for `castle`; the attention table pairs each name with its options class);
  block_size: tokens per block of the blockwise training path (default 64);
  kernel_config: the kernels' config for training and prefill, as "block_q=64,block_k=32,..."
    (the fields of model.attention_impl's config type: `CastleTritonConfig` for "triton",
    `CastleMosaicConfig` for "mosaic"; model.attention_impl must be set to one of them) or
    None for the default;
  decode_kernel_config: the decoding kernel's tiles ("block_rows=64,splits=4",
    `CastleDecodeConfig` fields) or None.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import flax.linen as nn
import jax

from castle_jax.layers.options import (
  AttentionOptions,
  check_positive_int,
  kernel_config_option,
  reject_sliding_window,
)
from castle_jax.layers.rope import apply_rope
from castle_jax.layers.shared import mean_visible_keys, output_projection, projection
from castle_jax.ops.castle import (
  DEFAULT_BLOCK_SIZE,
  KERNEL_CONFIGS,
  UQKVCache,
  append_tokens,
  castle_attention,
  init_cache,
)
from castle_jax.sharding import constrain
from pallas_kernels.castle import CastleDecodeConfig, CastleMosaicConfig, CastleTritonConfig

if TYPE_CHECKING:  # layers read the config's attributes only; castle_jax.config imports the attention table
  from castle_jax.config import ModelConfig

_ACTIVATION_AXES = ("batch", "act_length", "act_heads", "head_dim")
# The six per-head projections, in the op's argument order.
_PROJECTIONS = ("lookahead_query", "lookahead_key", "lookahead_value", "causal_query", "causal_key", "causal_value")
_ROTATED = frozenset(("lookahead_query", "lookahead_key", "lookahead_value", "causal_query", "causal_key"))


@dataclasses.dataclass(frozen=True)
class CastleOptions(AttentionOptions):
  """Options of `castle` (see the module docstring); `CastleSWLOptions` for `castle_swl`."""

  # Whether lookahead keys see a sliding window of W later tokens (CASTLE-SWL, Eq. 8).
  sliding: ClassVar[bool] = False

  lookahead_window: int | None = None
  block_size: int = DEFAULT_BLOCK_SIZE
  kernel_config: CastleTritonConfig | CastleMosaicConfig | str | None = None
  decode_kernel_config: CastleDecodeConfig | str | None = None

  def __post_init__(self):
    if self.sliding and self.lookahead_window is None:
      raise ValueError(
        "attention 'castle_swl' needs model.attention_kwargs.lookahead_window = W >= 1 "
        "(the paper uses 128 for S and 512 for M/L/XL)"
      )
    if not self.sliding and self.lookahead_window is not None:
      raise ValueError(
        "attention 'castle' has no lookahead window; use attention 'castle_swl' "
        "to slide a window over the lookahead keys"
      )
    if self.lookahead_window is not None:  # None was checked above, against the attention
      check_positive_int("lookahead_window", self.lookahead_window)
    check_positive_int("block_size", self.block_size)

  def for_model(self, config: ModelConfig) -> "CastleOptions":
    if config.n_kv_heads not in (0, config.n_heads):
      raise ValueError(
        f"CASTLE has no grouped-query form: model.n_kv_heads must be 0 or n_heads "
        f"({config.n_heads}), got {config.n_kv_heads}"
      )
    reject_sliding_window(
      config,
      "CASTLE attends to every causal key. Set it to 0 (for CASTLE-SWL use "
      "attention 'castle_swl' with model.attention_kwargs.lookahead_window)",
    )
    # Strings from a config file become the kernel configs of model.attention_impl once, here.
    implementation = config.attention_impl
    return dataclasses.replace(
      self,
      kernel_config=kernel_config_option("kernel_config", self.kernel_config, KERNEL_CONFIGS, implementation),
      decode_kernel_config=kernel_config_option(
        "decode_kernel_config",
        self.decode_kernel_config,
        {"triton": CastleDecodeConfig, "mosaic": CastleDecodeConfig},  # both decode with the Triton kernel
        implementation,
      ),
    )


@dataclasses.dataclass(frozen=True)
class CastleSWLOptions(CastleOptions):
  """Options of `castle_swl`: as `castle`, with lookahead_window required."""

  sliding: ClassVar[bool] = True


def cache_for(config: ModelConfig, batch: int, capacity: int) -> UQKVCache:
  return init_cache(
    batch, capacity, config.n_heads, config.qk_head_dim, config.compute_dtype, config.options.lookahead_window
  )


def param_count(config: ModelConfig) -> int:
  return 7 * config.n_heads * config.qk_head_dim * config.d_model


def core_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Forward + backward (3x forward) FLOPs per token of the attention core.

  Per (query t, key s) pair the forward does six d-long products: q^C.k^C, p.v^C and
  the lookahead score's q^C.D (over all causal pairs), and q^U.k^U, the D update and
  q^C.v^U (only within the lookahead window under SWL). The in-block term of the
  blockwise algorithm (block_size-long products) is an implementation cost, not counted.
  """
  causal = mean_visible_keys(seq_len, None)
  lookahead = mean_visible_keys(seq_len, config.options.lookahead_window)
  per_head = 2 * config.qk_head_dim * (3 * causal + 3 * lookahead)
  return 3 * config.n_heads * per_head


class MultiHeadCastle(nn.Module):
  """Multi-head causal attention with lookahead keys (CASTLE, or CASTLE-SWL when the
  options carry a lookahead window).

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
    options = cfg.options
    heads, head_dim = cfg.n_heads, cfg.qk_head_dim
    inputs = []
    for name in _PROJECTIONS:
      y = projection((heads, head_dim), ("embed", "heads", "head_dim"), cfg.init_std, cfg, name)(x)
      if name in _ROTATED:
        y = apply_rope(y, positions, cfg.rope_theta, cfg.rope_scaling)
      inputs.append(constrain(y, _ACTIVATION_AXES))
    if cache is None:
      out = castle_attention(
        *inputs,
        window=options.lookahead_window,
        implementation=cfg.attention_impl,
        block_size=options.block_size,
        kernel_config=options.kernel_config,
      )
    else:
      out, cache = append_tokens(
        cache,
        *inputs,
        block_size=options.block_size,
        implementation=cfg.attention_impl,
        kernel_config=options.kernel_config,
        decode_kernel_config=options.decode_kernel_config,
      )
    return output_projection(cfg, out), cache
