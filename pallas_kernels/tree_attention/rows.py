"""The query rows of the tree attention kernels: the heads that share a KV head are rows of
the same products (row r = node r // group, head r % group), so that the cache is read once
for all of them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rows_of_heads(x: jax.Array, kv_heads: int) -> jax.Array:
  """[batch, n, heads, d] -> [batch, kv_heads, n * group, d]; row r = node r // group."""
  batch, n, heads, head_dim = x.shape
  grouped = x.reshape(batch, n, kv_heads, heads // kv_heads, head_dim)
  return grouped.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, n * (heads // kv_heads), head_dim)


def heads_of_rows(x: jax.Array, n: int, heads: int) -> jax.Array:
  """Inverse of `rows_of_heads` on the first n * group rows; [..., d] or without d."""
  batch, kv_heads = x.shape[:2]
  group = heads // kv_heads
  tail = x.shape[3:]
  grouped = x[:, :, : n * group].reshape(batch, kv_heads, n, group, *tail)
  moved = jnp.moveaxis(grouped, 1, 2)  # [batch, n, kv_heads, group, ...]
  return moved.reshape(batch, n, heads, *tail)
