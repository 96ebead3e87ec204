"""The (query chunk, slot) pairs that retrieved each memory chunk: what the memory-side
backward kernels (Triton and Mosaic) walk to sum each chunk's dK and dV deterministically."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def retrieving_pairs(indices: jax.Array, weights: jax.Array, memory_chunks: int) -> tuple[jax.Array, jax.Array]:
  """(order int32 [batch, query_chunks * k], starts int32 [batch, memory_chunks + 1]): the flat
  (query chunk * k + slot) pairs sorted by the chunk they retrieved, and where each chunk's
  run begins. Pairs of weight 0 contribute nothing to dK and dV: they sort last, past every run."""
  batch = indices.shape[0]
  chunks = jnp.where(weights != 0, indices, memory_chunks).reshape(batch, -1)
  order = jnp.argsort(chunks, axis=-1, stable=True)
  sorted_chunks = jnp.take_along_axis(chunks, order, axis=-1)
  starts = jax.vmap(lambda s: jnp.searchsorted(s, jnp.arange(memory_chunks + 1), side="left"))(sorted_chunks)
  return order.astype(jnp.int32), starts.astype(jnp.int32)
