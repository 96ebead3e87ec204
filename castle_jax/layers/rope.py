"""Rotary position embeddings (Su et al., 2021), "rotate half" layout as in LLaMA, with
Llama 3's scaling of the frequencies (`rope_scaling`) as an option."""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

# The keys of Llama 3's frequency scaling (model.rope_scaling with type "llama3").
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_SCALING_TYPES = ("llama3",)


def check_rope_scaling(scaling: Mapping[str, Any]) -> None:
  """ValueError unless `scaling` is empty (no scaling) or a complete "llama3" scaling."""
  if not scaling:
    return
  kind = scaling.get("type")
  if kind not in ROPE_SCALING_TYPES:
    raise ValueError(f"model.rope_scaling type {kind!r} is not supported; supported: {ROPE_SCALING_TYPES} (or none)")
  keys = set(scaling) - {"type"}
  if keys != set(LLAMA3_KEYS):
    raise ValueError(
      f"model.rope_scaling of type 'llama3' needs exactly the keys {sorted(LLAMA3_KEYS)} besides 'type', got {sorted(keys)}"
    )
  if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
    raise ValueError(
      f"model.rope_scaling high_freq_factor ({scaling['high_freq_factor']}) must exceed low_freq_factor "
      f"({scaling['low_freq_factor']})"
    )


def rope_inv_freq(head_dim: int, theta: float = 10_000.0, scaling: Any = ()) -> jax.Array:
  """float32 [head_dim / 2]: the rotation frequency of each channel pair.

  theta^(-2i / head_dim), then, with a "llama3" `scaling` ((key, value) pairs or a
  mapping, see `check_rope_scaling`), Llama 3's long-context adjustment as transformers
  computes it: wavelengths 2 pi / f longer than original_max_position_embeddings /
  low_freq_factor are slowed down by `factor`, those shorter than
  original_max_position_embeddings / high_freq_factor are kept, and those between are
  interpolated linearly in original_max_position_embeddings / wavelength.
  """
  half = head_dim // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  scaling = dict(scaling)
  check_rope_scaling(scaling)
  if not scaling:
    return inv_freq
  factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
  old_context = scaling["original_max_position_embeddings"]
  wavelength = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
  smooth = (old_context / wavelength - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelength < old_context / high) & ~(wavelength > old_context / low)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10_000.0, scaling: Any = ()) -> jax.Array:
  """Rotates channel pairs (i, i + head_dim/2) by position-dependent angles.

  Args:
    x: [batch, seq, heads, head_dim] with an even head_dim.
    positions: int [batch, seq], absolute token positions.
    theta: base of the geometric frequency ladder.
    scaling: model.rope_scaling ((key, value) pairs; empty: none), see `rope_inv_freq`.

  Returns:
    x rotated, same shape and dtype; the rotation itself runs in float32.
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
  inv_freq = rope_inv_freq(head_dim, theta, scaling)
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, half]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
