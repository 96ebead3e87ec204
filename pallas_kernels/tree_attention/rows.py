"""The query rows of the tree attention kernels: the heads that share a KV head are rows of
the same products (row r = node r // group, head r % group), so that the cache is read once
for all of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rows_of_heads(x: jax.Array, kv_heads: int, padded_rows: int) -> jax.Array:
  """[batch, n, heads, d] -> [batch, kv_heads, padded_rows, d]; row r = node r // group, the
  rows past n * group zero (padding to the kernel's tiles)."""
  batch, n, heads, head_dim = x.shape
  rows = n * (heads // kv_heads)
  grouped = x.reshape(batch, n, kv_heads, heads // kv_heads, head_dim)
  rows_first = grouped.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, rows, head_dim)
  return jnp.pad(rows_first, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))


def tree_mask_rows(tree_mask: jax.Array, batch: int, group: int, padded_rows: int, padded_nodes: int) -> jax.Array:
  """bool [batch, padded_rows, padded_nodes]: row r sees node j iff node r // group does
  (`tree_mask`: bool [batch, n, n] or [n, n]); padding rows see nothing and padding nodes
  are seen by no row."""
  n = tree_mask.shape[-1]
  rows = jnp.repeat(jnp.broadcast_to(tree_mask, (batch, n, n)), group, axis=1)
  return jnp.pad(rows, ((0, 0), (0, padded_rows - n * group), (0, padded_nodes - n)))


def heads_of_rows(x: jax.Array, n: int, heads: int) -> jax.Array:
  """Inverse of `rows_of_heads` on the first n * group rows; [..., d] or without d."""
  batch, kv_heads = x.shape[:2]
  group = heads // kv_heads
  tail = x.shape[3:]
  grouped = x[:, :, : n * group].reshape(batch, kv_heads, n, group, *tail)
  moved = jnp.moveaxis(grouped, 1, 2)  # [batch, n, kv_heads, group, ...]
  return moved.reshape(batch, n, heads, *tail)
