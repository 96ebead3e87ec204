"""Shapes, checks and the off-by-one softmax shared by the GCA paths.

Grouped cross attention (GCA; Hu et al., "Efficient Length-Generalizable Attention via
Causal Retrieval", Eqs. 2-3). The query tokens are split into query chunks; query chunk
c attends to k retrieved memory chunks, separately per chunk, and mixes the k results
with the chunk weights:

    O_c = sum_j w[c, j] * softmax_1(Q_c K_{idx[c, j]}^T * scale) V_{idx[c, j]},
    softmax_1(z)_i = exp(z_i) / (1 + sum_l exp(z_l)),

per head, with grouped-query heads (query head h reads key/value head h // (heads /
kv_heads)). The "+1" lets a query ignore a chunk whose keys do not match it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softmax_one(scores: jax.Array, axis: int = -1) -> jax.Array:
  """softmax_1 along `axis`: exp(z_i) / (1 + sum_l exp(z_l)), overflow-free.

  Equal to a softmax over the scores with one extra logit fixed at 0 whose value row is
  zero (what the authors' code does by zeroing the landmark row of K and V).
  """
  top = jnp.maximum(jnp.max(scores, axis=axis, keepdims=True), 0.0)
  top = jax.lax.stop_gradient(top)
  exp = jnp.exp(scores - top)
  return exp / (jnp.exp(-top) + jnp.sum(exp, axis=axis, keepdims=True))


def log_normalizer_one(scores: jax.Array, axis: int = -1) -> jax.Array:
  """log(1 + sum_l exp(z_l)) along `axis` (keepdims), overflow-free: the log-sum-exp
  that softmax_1 divides by, stored by the XLA path for its backward."""
  top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=axis, keepdims=True), 0.0))
  return top + jnp.log(jnp.exp(-top) + jnp.sum(jnp.exp(scores - top), axis=axis, keepdims=True))


def validate_inputs(q, chunk_k, chunk_v, chunk_weights, chunk_indices) -> tuple[int, int]:
  """Checks shapes and dtypes; returns (query chunk length, heads per kv head).

  Raises:
    ValueError: naming the argument and the expected shape.
  """
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, seq, heads, head_dim]; got shape {q.shape}")
  for name, x in (("chunk_k", chunk_k), ("chunk_v", chunk_v)):
    if x.ndim != 5:
      raise ValueError(f"{name} must be [batch, memory_chunks, chunk_len, kv_heads, head_dim]; got shape {x.shape}")
  if chunk_k.shape != chunk_v.shape:
    raise ValueError(f"chunk_k {chunk_k.shape} and chunk_v {chunk_v.shape} must have the same shape")
  if chunk_indices.ndim != 3:
    raise ValueError(f"chunk_indices must be int [batch, query_chunks, k]; got shape {chunk_indices.shape}")
  if not jnp.issubdtype(chunk_indices.dtype, jnp.integer):
    raise ValueError(f"chunk_indices must be integers, got dtype {chunk_indices.dtype}")
  if chunk_weights.shape != chunk_indices.shape:
    raise ValueError(
      f"chunk_weights {chunk_weights.shape} must have chunk_indices' shape {chunk_indices.shape} "
      "([batch, query_chunks, k])"
    )
  if not jnp.issubdtype(chunk_weights.dtype, jnp.floating):
    raise ValueError(f"chunk_weights must be floating point, got dtype {chunk_weights.dtype}")
  batch, seq, heads, head_dim = q.shape
  if chunk_k.shape[0] != batch or chunk_indices.shape[0] != batch:
    raise ValueError(
      f"batch sizes differ: q {batch}, chunk_k {chunk_k.shape[0]}, chunk_indices {chunk_indices.shape[0]}"
    )
  if chunk_k.shape[-1] != head_dim:
    raise ValueError(f"chunk_k head_dim {chunk_k.shape[-1]} must equal q's {head_dim}")
  kv_heads = chunk_k.shape[3]
  if heads % kv_heads:
    raise ValueError(f"q heads ({heads}) must be a multiple of chunk_k/chunk_v kv_heads ({kv_heads})")
  query_chunks, top_k = chunk_indices.shape[1:]
  if query_chunks < 1 or seq % query_chunks:
    raise ValueError(
      f"q's seq ({seq}) must be a positive multiple of the query chunks in chunk_indices "
      f"({query_chunks}): each query chunk has seq // query_chunks tokens"
    )
  if top_k < 1:
    raise ValueError(f"chunk_indices must retrieve k >= 1 chunks per query chunk; got k = {top_k}")
  if chunk_k.shape[1] < 1 or chunk_k.shape[2] < 1:
    raise ValueError(f"chunk_k must hold at least one chunk of at least one token; got shape {chunk_k.shape}")
  return seq // query_chunks, heads // kv_heads


def gather_chunks(chunks: jax.Array, indices: jax.Array) -> jax.Array:
  """chunks [batch, memory_chunks, ...] at indices int [batch, ...] -> [batch, *indices.shape[1:], ...].

  A gather, so its VJP scatter-adds: a memory chunk retrieved by several query chunks
  receives the sum of their gradients.
  """
  return jax.vmap(lambda c, i: jnp.take(c, i, axis=0, mode="clip"))(chunks, indices)
