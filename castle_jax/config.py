"""ModelConfig: the frozen, validated description of a model.

The one place model defaults are written: `train/config.py:base_config().model` is
derived from these fields' defaults.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax.numpy as jnp

from castle_jax.layers.options import AttentionOptions
from castle_jax.layers.registry import get_attention
from castle_jax.layers.rope import check_rope_scaling
from castle_jax.ops.backend import pallas_is_renamed
from pallas_kernels.residuals import save_attention_residuals

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# What a rematerialized block keeps from its forward for the backward.
REMAT_POLICIES = ("recompute_all", "save_attention")
# Fields that choose how the same function of the same parameters is computed, not which
# function: a run may continue (or start from another run's weights) with other values.
COMPUTATION_FIELDS = ("attention_impl", "remat", "remat_policy")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a model (by default a LLaMA-style decoder LM).

  Zero-valued fields are derived: n_kv_heads=0 means n_heads, head_dim=0 means
  d_model // n_heads, mlp_hidden=0 means 8/3 * d_model rounded to the nearest
  multiple of mlp_multiple_of (an odd width such as 8/3 * 896 = 2389 runs the MLP
  matmuls measurably slower on an H100), sliding_window=0 means full causal attention.

  Attributes:
    family: the model family (`castle_jax.models.registry.MODEL_FAMILIES`).
    vocab_size: >= the tokenizer's vocabulary; a multiple of 128 shards evenly.
    d_model, n_layers, n_heads: widths and depth.
    n_kv_heads: 0 for plain multi-head; fewer than n_heads for grouped-query attention.
    head_dim: 0 for d_model // n_heads.
    mlp_hidden, mlp_multiple_of: SwiGLU width (0: 8/3 * d_model rounded to the multiple).
    tie_embeddings: the LM head is the embedding table.
    rope_theta, norm_eps: RoPE base and RMSNorm epsilon.
    rope_scaling: (key, value) pairs of a scaling of the RoPE frequencies (empty: none):
      type "llama3" with factor, low_freq_factor, high_freq_factor and
      original_max_position_embeddings (Llama 3.1/3.2; `castle_jax.layers.rope.rope_inv_freq`).
    qkv_bias: the query, key and value projections have biases (Qwen2); `mha` only (a
      LongSpec draft's own self-attention then has them too).
    attention: a name in the attention table (`castle_jax.layers.registry.ATTENTIONS`).
    attention_impl: the attention op's implementation, one of that attention's
      implementations (e.g. "reference", "xla", "triton", "mosaic"; "cudnn" for `mha`),
      or None for the fastest that runs here.
    sliding_window: 0 for full causal attention; W > 0: each `mha` query sees the last W keys.
    dtype: activations and matmul inputs; param_dtype: parameters.
    remat: rematerialize each block in the backward pass.
    remat_policy: with remat, what the backward keeps from the forward: "recompute_all"
      (only each block's input: the least memory) or "save_attention" (also the attention
      ops' outputs and residuals, O(T d) per layer, so the attention kernels' forward runs
      once per step instead of twice).
    init_std: std of the normal initializers (output projections are scaled down with depth).
    family_kwargs: (key, value) pairs of the model family's options (e.g. DRT's chunk
      size and retrieval), parsed by the family when the model is built.
    attention_kwargs: (key, value) pairs of the attention's options, parsed into its
      options dataclass (`options`); unknown keys are errors.
  """

  family: str = "transformer"
  vocab_size: int = 384
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 0
  head_dim: int = 0
  mlp_hidden: int = 0
  mlp_multiple_of: int = 64
  tie_embeddings: bool = True
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  # Hashable (key, value) pairs, like attention_kwargs.
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  qkv_bias: bool = False
  attention: str = "mha"
  attention_impl: str | None = None
  sliding_window: int = 0
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: bool = False
  remat_policy: str = "recompute_all"
  init_std: float = 0.02
  # Hashable (key, value) pairs: the config is a static argument of compiled functions.
  attention_kwargs: tuple[tuple[str, Any], ...] = ()
  family_kwargs: tuple[tuple[str, Any], ...] = ()

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
    if self.mlp_multiple_of < 1:
      raise ValueError(f"model.mlp_multiple_of must be >= 1, got {self.mlp_multiple_of}")
    for name in ("n_kv_heads", "head_dim", "mlp_hidden", "sliding_window"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.{name} must be >= 0 (0 means derived/off), got {getattr(self, name)}")
    if self.n_heads % self.kv_heads:
      raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.kv_heads})")
    if not self.head_dim and self.d_model % self.n_heads:
      raise ValueError(
        f"model.d_model ({self.d_model}) is not divisible by model.n_heads ({self.n_heads}); set model.head_dim"
      )
    if self.qk_head_dim % 2:
      raise ValueError(f"head dim must be even for RoPE, got {self.qk_head_dim}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"model.remat_policy must be one of {REMAT_POLICIES}, got {self.remat_policy!r}")
    check_rope_scaling(dict(self.rope_scaling))
    # A LongSpec draft's config describes its `mha` target, whose projections may have biases.
    if self.qkv_bias and (self.attention != "mha" or self.family not in ("transformer", "longspec_draft")):
      raise ValueError(
        "model.qkv_bias is supported for the 'transformer' family (and a LongSpec draft of one) with 'mha' "
        f"attention only, got family {self.family!r} with attention {self.attention!r}"
      )
    kind = get_attention(self.attention)
    if self.attention_impl == "pallas":
      raise ValueError(pallas_is_renamed(f"attention {self.attention!r}", kind.implementations, "model.attention_impl"))
    if self.attention_impl is not None and self.attention_impl not in kind.implementations:
      raise ValueError(
        f"model.attention_impl={self.attention_impl!r} is not an implementation of attention "
        f"{self.attention!r}; choose one of {kind.implementations} or None (the best the backend runs)"
      )
    self.options  # parses and checks model.attention_kwargs now, not at the first forward pass

  @classmethod
  def from_mapping(cls, fields: Mapping[str, Any]) -> "ModelConfig":
    """Builds from a dict or ConfigDict (e.g. `config.model`), rejecting unknown keys."""
    fields = dict(fields)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"Unknown model config keys {unknown}; known keys: {sorted(known)}")
    pairs = {
      name: tuple(sorted(dict(fields.pop(name, None) or {}).items()))
      for name in ("attention_kwargs", "family_kwargs", "rope_scaling")
    }
    return cls(**fields, **pairs)

  def to_mapping(self) -> dict[str, Any]:
    """The fields as `from_mapping` reads them (a config's `model` section): the (key,
    value) pairs of attention_kwargs, family_kwargs and rope_scaling as dicts."""
    fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
    for name in ("attention_kwargs", "family_kwargs", "rope_scaling"):
      fields[name] = dict(fields[name])
    return fields

  @functools.cached_property
  def options(self) -> AttentionOptions:
    """model.attention_kwargs parsed into the attention's options dataclass and checked
    against the rest of this config."""
    kind = get_attention(self.attention)
    return kind.options.from_kwargs(dict(self.attention_kwargs), self.attention).for_model(self)

  def derived_fields(self) -> dict[str, int]:
    """The values the fields that 0 means "derive" stand for: {"n_kv_heads": kv_heads,
    "head_dim": qk_head_dim, "mlp_hidden": ffn_hidden}."""
    return {"n_kv_heads": self.kv_heads, "head_dim": self.qk_head_dim, "mlp_hidden": self.ffn_hidden}

  @property
  def kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  @property
  def qk_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def ffn_hidden(self) -> int:
    if self.mlp_hidden:
      return self.mlp_hidden
    multiple = self.mlp_multiple_of
    return max(multiple, round(8 * self.d_model / 3 / multiple) * multiple)

  @property
  def window(self) -> int | None:
    return self.sliding_window or None

  @property
  def checkpoint_policy(self):
    """The `jax.checkpoint` policy of `remat_policy` (None: save nothing)."""
    return save_attention_residuals() if self.remat_policy == "save_attention" else None

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def weights_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def out_init_std(self) -> float:
    """Std of residual-branch output projections, scaled down with depth (GPT-2)."""
    return self.init_std / (2 * self.n_layers) ** 0.5
