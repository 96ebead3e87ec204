"""Merging the partial softmax states of split-K kernels (flash decoding).

A kernel that cuts the keys of a row into splits writes, per split, its running max,
the sum of exp(score - max) and the unnormalized output; the softmax over all keys is
their LSE-weighted combination. Shared by the CASTLE decoding step and tree attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_split_states(maxima: jax.Array, sums: jax.Array, accs: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Partial softmax states -> (output normalized, lse), both float32.

  Args:
    maxima, sums: float32 [splits, ...]; a split that saw no key has max -inf and sum 0.
    accs: float32 [splits, ..., d], the unnormalized outputs.

  Returns:
    out [..., d] (0 for a row that saw no key) and lse [...] (-inf for such a row).
  """
  overall = jnp.max(maxima, axis=0)
  shift = jnp.where(overall == -jnp.inf, 0.0, overall)
  weights = jnp.exp(maxima - shift)  # exp(-inf) = 0 for empty splits
  total = jnp.sum(weights * sums, axis=0)
  out = jnp.sum(weights[..., None] * accs, axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
  lse = jnp.where(total > 0, shift + jnp.log(total), -jnp.inf)
  return out, lse
