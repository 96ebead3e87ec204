"""Numerical conventions every op shares."""

from __future__ import annotations

import jax.numpy as jnp


def math_dtype(dtype) -> jnp.dtype:
  """The dtype the math runs in: at least float32 (bf16 inputs are upcast)."""
  return jnp.promote_types(dtype, jnp.float32)


def score_scale(head_dim: int) -> float:
  """The default score scale 1/sqrt(head_dim)."""
  return 1.0 / float(head_dim) ** 0.5
