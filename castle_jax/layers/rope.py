"""Rotary position embeddings (Su et al., 2021), "rotate half" layout as in LLaMA."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10_000.0) -> jax.Array:
  """Rotates channel pairs (i, i + head_dim/2) by position-dependent angles.

  Args:
    x: [batch, seq, heads, head_dim] with an even head_dim.
    positions: int [batch, seq], absolute token positions.
    theta: base of the geometric frequency ladder.

  Returns:
    x rotated, same shape and dtype; the rotation itself runs in float32.
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
  half = head_dim // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, half]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
