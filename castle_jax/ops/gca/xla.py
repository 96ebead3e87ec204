"""GCA in XLA, one retrieved chunk at a time, with a custom VJP that keeps only the
per-chunk log-normalizers.

Forward (paper App. B, Algorithm 1, in XLA): for each of the k slots j, gather the
slot's memory chunk for every query chunk ([batch, query_chunks, chunk_len, kv_heads,
head_dim], no [T, T] or [T, k, chunk_len] score tensor), score it against the query
chunk, normalize with softmax_1 and add w_j * O'_j to the output. The residuals are
the inputs and lse_j = log(1 + sum_s exp(score_s)), [k, batch, query_chunks, kv_heads,
group, query_len].

Backward (App. B, Algorithm 2): per slot, recompute P_j = exp(S_j - lse_j) and
O'_j = P_j V_j, then
  dw_j  = sum over heads, rows and features of dO * O'_j,
  dO'_j = w_j dO,   dP_j = dO'_j V_j^T,   dS_j = P_j (dP_j - rowsum(dO'_j * O'_j)),
  dQ   += dS_j K_j scale,   dK_j = dS_j^T Q scale,   dV_j = P_j^T dO'_j,
and scatter-add dK_j, dV_j into the memory chunks they were gathered from (a chunk
retrieved by several query chunks sums their gradients). softmax_1's Jacobian has the
softmax's form (the implicit zero logit is a constant), so dS is the flash-attention one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import math_dtype
from castle_jax.ops.gca.common import gather_chunks, log_normalizer_one, validate_inputs
from pallas_kernels.residuals import keep_for_backward


def gca_chunked(
  q: jax.Array,
  chunk_k: jax.Array,
  chunk_v: jax.Array,
  chunk_weights: jax.Array,
  chunk_indices: jax.Array,
  *,
  scale: float | None = None,
) -> jax.Array:
  """GCA, memory O(T d + T k) for the backward. Args and result: as `gca_attention`."""
  query_len, group = validate_inputs(q, chunk_k, chunk_v, chunk_weights, chunk_indices)
  batch, seq, heads, head_dim = q.shape
  scale = head_dim**-0.5 if scale is None else float(scale)
  kv_heads = chunk_k.shape[3]
  queries = q.reshape(batch, chunk_indices.shape[1], query_len, kv_heads, group, head_dim)
  out = _gca(queries, chunk_k, chunk_v, chunk_weights, chunk_indices.astype(jnp.int32), scale)
  return out.reshape(batch, seq, heads, head_dim)


def _slot_scores(queries, keys, scale):
  """queries [b, n, q, h, g, d] x keys [b, n, s, h, d] -> scores [b, n, h, g, q, s] (float32 or wider)."""
  return jnp.einsum("bnqhgd,bnshd->bnhgqs", queries, keys) * scale


def _slot_output(probs, values):
  """probs [b, n, h, g, q, s] x values [b, n, s, h, d] -> [b, n, q, h, g, d]."""
  return jnp.einsum("bnhgqs,bnshd->bnqhgd", probs, values)


def _forward(queries, chunk_k, chunk_v, chunk_weights, chunk_indices, scale):
  dtype = math_dtype(queries.dtype)
  queries32 = queries.astype(dtype)
  weights = chunk_weights.astype(dtype)

  def slot(out, j):
    keys = gather_chunks(chunk_k, chunk_indices[:, :, j]).astype(dtype)
    values = gather_chunks(chunk_v, chunk_indices[:, :, j]).astype(dtype)
    scores = _slot_scores(queries32, keys, scale)
    lse = log_normalizer_one(scores)
    out = out + weights[:, :, j, None, None, None, None] * _slot_output(jnp.exp(scores - lse), values)
    return out, lse[..., 0]

  out, lse = jax.lax.scan(slot, jnp.zeros(queries.shape, dtype), jnp.arange(chunk_indices.shape[2]))
  return out.astype(queries.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _gca(queries, chunk_k, chunk_v, chunk_weights, chunk_indices, scale):
  return _forward(queries, chunk_k, chunk_v, chunk_weights, chunk_indices, scale)[0]


def _gca_fwd(queries, chunk_k, chunk_v, chunk_weights, chunk_indices, scale):
  out, lse = keep_for_backward(_forward(queries, chunk_k, chunk_v, chunk_weights, chunk_indices, scale))
  return out, (queries, chunk_k, chunk_v, chunk_weights, chunk_indices, lse)


def _scatter_add(total, indices, update):
  """total [b, m, ...] += update [b, n, ...] at rows indices [b, n]."""
  return jax.vmap(lambda t, i, u: t.at[i].add(u, mode="clip"))(total, indices, update)


def _gca_bwd(scale, residuals, d_out):
  queries, chunk_k, chunk_v, chunk_weights, chunk_indices, lse = residuals
  dtype = math_dtype(queries.dtype)
  queries32 = queries.astype(dtype)
  weights = chunk_weights.astype(dtype)
  d_out = d_out.astype(dtype)

  def slot(carry, j):
    d_queries, d_chunk_k, d_chunk_v = carry
    index = chunk_indices[:, :, j]
    keys = gather_chunks(chunk_k, index).astype(dtype)
    values = gather_chunks(chunk_v, index).astype(dtype)
    probs = jnp.exp(_slot_scores(queries32, keys, scale) - lse[j][..., None])
    slot_out = _slot_output(probs, values)  # O'_j: [b, n, q, h, g, d]
    d_weight = jnp.sum(d_out * slot_out, axis=(2, 3, 4, 5))
    d_slot_out = weights[:, :, j, None, None, None, None] * d_out
    d_probs = jnp.einsum("bnqhgd,bnshd->bnhgqs", d_slot_out, values)
    row_dot = jnp.einsum("bnqhgd,bnqhgd->bnhgq", d_slot_out, slot_out)[..., None]
    d_scores = probs * (d_probs - row_dot) * scale
    d_queries = d_queries + jnp.einsum("bnhgqs,bnshd->bnqhgd", d_scores, keys)
    d_keys = jnp.einsum("bnhgqs,bnqhgd->bnshd", d_scores, queries32)
    d_values = jnp.einsum("bnhgqs,bnqhgd->bnshd", probs, d_slot_out)
    d_chunk_k = _scatter_add(d_chunk_k, index, d_keys)
    d_chunk_v = _scatter_add(d_chunk_v, index, d_values)
    return (d_queries, d_chunk_k, d_chunk_v), d_weight

  init = (jnp.zeros(queries.shape, dtype), jnp.zeros(chunk_k.shape, dtype), jnp.zeros(chunk_v.shape, dtype))
  (d_queries, d_chunk_k, d_chunk_v), d_weights = jax.lax.scan(slot, init, jnp.arange(chunk_indices.shape[2]))
  return (
    d_queries.astype(queries.dtype),
    d_chunk_k.astype(chunk_k.dtype),
    d_chunk_v.astype(chunk_v.dtype),
    jnp.moveaxis(d_weights, 0, -1).astype(chunk_weights.dtype),
    None,
  )


_gca.defvjp(_gca_fwd, _gca_bwd)
