"""Merging the partial softmax states of split-K kernels (flash decoding).

A kernel that cuts the keys of a row into splits writes, per split, its running max,
the sum of exp(score - max) and the unnormalized output; the softmax over all keys is
their LSE-weighted combination. Shared by the CASTLE decoding step and tree attention, as is
how a row's filled key blocks are shared among the splits (`split_blocks`).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def split_blocks(filled, split, *, splits: int, block: int):
  """(first, stop): the blocks of `block` slots that split number `split` of `splits` reads,
  its share of the ceil(filled / block) blocks that hold the `filled` slots (scalars, traced
  in a kernel). A split past the filled blocks has stop <= first: no blocks."""
  total_blocks = lax.div(filled + block - 1, block)
  per_split = lax.div(total_blocks + splits - 1, splits)
  first = split * per_split
  return first, jnp.minimum(first + per_split, total_blocks)


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
