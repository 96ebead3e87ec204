"""Zero padding of GCA inputs to the tiles of a kernel family, and its undoing.

Both kernel families (Triton: `triton`; Mosaic GPU: `mosaic_tiles`) view the queries as
[batch, query_chunks, query_len, heads, head_dim], pad each query chunk with zero rows
and each memory chunk with zero keys (masked out of every softmax_1 by the kernels), and
slice the padded rows off the output. They differ only in the padded sizes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PaddedInputs:
  """The kernels' padded arrays (`arrays`: queries [batch, query_chunks, query_rows, heads,
  head_dim], keys and values [batch, memory_chunks, padded chunk_len, kv_heads, head_dim],
  float32 weights, int32 indices clipped into range) and what undoes the padding."""

  arrays: tuple
  query_len: int
  chunk_len: int

  def unpad(self, rows):
    """[batch, query_chunks, query_rows, heads, X] -> [batch, seq, heads, X]."""
    batch, query_chunks, _, heads, width = rows.shape
    return rows[:, :, : self.query_len].reshape(batch, query_chunks * self.query_len, heads, width)


def pad(q, chunk_k, chunk_v, chunk_weights, chunk_indices, *, query_rows: int, chunk_tile: int) -> PaddedInputs:
  """Each query chunk of q ([batch, seq, heads, head_dim], seq = query_chunks x query_len)
  padded to `query_rows` rows, each memory chunk of chunk_k and chunk_v ([batch,
  memory_chunks, chunk_len, kv_heads, head_dim]) to `chunk_tile` keys; sizes are the
  caller's to check."""
  batch, seq, heads, head_dim = q.shape
  memory_chunks, chunk_len = chunk_k.shape[1:3]
  query_chunks = chunk_indices.shape[1]
  query_len = seq // query_chunks
  queries = q.reshape(batch, query_chunks, query_len, heads, head_dim)
  queries = jnp.pad(queries, ((0, 0), (0, 0), (0, query_rows - query_len), (0, 0), (0, 0)))
  key_padding = ((0, 0), (0, 0), (0, chunk_tile - chunk_len), (0, 0), (0, 0))
  keys, values = jnp.pad(chunk_k, key_padding), jnp.pad(chunk_v, key_padding)
  indices = jnp.clip(chunk_indices.astype(jnp.int32), 0, memory_chunks - 1)
  return PaddedInputs((queries, keys, values, chunk_weights.astype(jnp.float32), indices), query_len, chunk_len)
