"""ModelConfig: the frozen, validated description of a decoder LM."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a LLaMA-style decoder LM.

  Zero-valued fields are derived: n_kv_heads=0 means n_heads, head_dim=0 means
  d_model // n_heads, mlp_hidden=0 means 8/3 * d_model rounded to the nearest
  multiple of mlp_multiple_of (an odd width such as 8/3 * 896 = 2389 runs the MLP
  matmuls ~1.5x slower on an H100), sliding_window=0
  means full causal attention.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int = 0
  head_dim: int = 0
  mlp_hidden: int = 0
  mlp_multiple_of: int = 64
  tie_embeddings: bool = True
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  attention: str = "mha"
  attention_impl: str | None = None
  sliding_window: int = 0
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: bool = False
  init_std: float = 0.02
  # Hashable (key, value) pairs of attention-specific options.
  attention_kwargs: tuple[tuple[str, Any], ...] = ()

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
          f"model.d_model ({self.d_model}) is not divisible by model.n_heads ({self.n_heads}); set model.head_dim")
    if self.qk_head_dim % 2:
      raise ValueError(f"head dim must be even for RoPE, got {self.qk_head_dim}")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"model.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")

  @classmethod
  def from_mapping(cls, fields: Mapping[str, Any]) -> "ModelConfig":
    """Builds from a dict or ConfigDict (e.g. `config.model`), rejecting unknown keys."""
    fields = dict(fields)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
      raise ValueError(f"Unknown model config keys {unknown}; known keys: {sorted(known)}")
    kwargs = fields.pop("attention_kwargs", None) or {}
    return cls(**fields, attention_kwargs=tuple(sorted(dict(kwargs).items())))

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
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def weights_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def attention_options(self) -> dict[str, Any]:
    return dict(self.attention_kwargs)

  @property
  def out_init_std(self) -> float:
    """Std of residual-branch output projections, scaled down with depth (GPT-2)."""
    return self.init_std / (2 * self.n_layers) ** 0.5
