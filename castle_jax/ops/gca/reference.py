"""GCA and causal chunk retrieval straight from the definitions (test oracles).

Retrieval (paper Eq. 1 and Sec. 3.2; the authors' code for the score):
  score[t, c] = <q_t, l_c> * scale for memory chunk c < t, -inf otherwise (causal: chunk t
            retrieves only from chunks before it, and its retrieval serves chunk t + 1),
            where q_t is chunk t's landmark state (after the group's RMSNorm) and l_c is
            memory chunk c's landmark from the chunk encoder;
  indices = top_k(score + Gumbel noise) in training, top_k(score) otherwise;
  weights = softmax of the noise-free scores over the selected chunks (slots that hold
            no past chunk get weight 0). The indices carry no gradient; the scores do,
            through the weights.
GCA (Eqs. 2-3): see `common`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import math_dtype
from castle_jax.ops.gca.common import gather_chunks, softmax_one, validate_inputs


def gca_reference(
  q: jax.Array,
  chunk_k: jax.Array,
  chunk_v: jax.Array,
  chunk_weights: jax.Array,
  chunk_indices: jax.Array,
  *,
  scale: float | None = None,
) -> jax.Array:
  """sum_j w[c, j] softmax_1(Q_c K_{idx[c, j]}^T scale) V_{idx[c, j]}, materializing every
  retrieved chunk's scores ([batch, query_chunks, k, chunk_tokens, heads, chunk_len]).

  Args: as `castle_jax.ops.gca.gca_attention`.

  Returns:
    [batch, seq, heads, head_dim] in q's dtype.
  """
  query_len, group = validate_inputs(q, chunk_k, chunk_v, chunk_weights, chunk_indices)
  batch, seq, heads, head_dim = q.shape
  dtype = math_dtype(q.dtype)
  scale = head_dim**-0.5 if scale is None else scale
  query_chunks = chunk_indices.shape[1]
  queries = q.reshape(batch, query_chunks, query_len, heads, head_dim).astype(dtype)
  keys = jnp.repeat(gather_chunks(chunk_k, chunk_indices), group, axis=4).astype(dtype)
  values = jnp.repeat(gather_chunks(chunk_v, chunk_indices), group, axis=4).astype(dtype)
  # keys/values: [batch, query_chunks, k, chunk_len, heads, head_dim]
  scores = jnp.einsum("bnqhd,bnjshd->bnjhqs", queries, keys, precision="highest") * scale
  per_chunk = jnp.einsum("bnjhqs,bnjshd->bnjqhd", softmax_one(scores), values, precision="highest")
  out = jnp.einsum("bnj,bnjqhd->bnqhd", chunk_weights.astype(dtype), per_chunk, precision="highest")
  return out.reshape(batch, seq, heads, head_dim).astype(q.dtype)


def causal_chunk_mask(num_chunks: int) -> jax.Array:
  """bool [num_chunks, num_chunks]: entry [t, c] is True iff chunk t may retrieve chunk c (c < t)."""
  positions = jnp.arange(num_chunks)
  return positions[None, :] < positions[:, None]


def retrieval_scores(
  queries: jax.Array, landmarks: jax.Array, *, scale: float | None = None, query_chunks: jax.Array | None = None
) -> jax.Array:
  """Relevance of every earlier chunk to each chunk, -inf where retrieval is not causal.

  Args:
    queries: [batch, chunks, dim], chunk t's landmark state in the retrieving layer group.
    landmarks: [batch, memory_chunks, dim], the chunk encoder's landmark of each memory
      chunk (memory_chunks == chunks unless query_chunks is given).
    scale: default 1/sqrt(dim).
    query_chunks: int [chunks], the chunk number of each query (default 0..chunks-1):
      decoding scores a few new chunks against a store of every landmark so far.

  Returns:
    float32 [batch, chunks (t), memory_chunks (c)]: <q_t, l_c> * scale for c < t, else -inf.
  """
  same_chunks = query_chunks is not None or landmarks.shape == queries.shape
  if queries.ndim != 3 or landmarks.ndim != 3 or not same_chunks or landmarks.shape[::2] != queries.shape[::2]:
    raise ValueError(
      f"queries and landmarks must both be [batch, chunks, dim]; got {queries.shape} and {landmarks.shape}"
    )
  scale = queries.shape[-1] ** -0.5 if scale is None else scale
  scores = (
    jnp.einsum("btd,bcd->btc", queries.astype(jnp.float32), landmarks.astype(jnp.float32), precision="highest") * scale
  )
  if query_chunks is None:
    return jnp.where(causal_chunk_mask(queries.shape[1]), scores, -jnp.inf)
  causal = jnp.arange(landmarks.shape[1])[None, :] < query_chunks[:, None]
  return jnp.where(causal, scores, -jnp.inf)


def select_chunks(scores: jax.Array, top_k: int, *, gumbel_rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Top-k retrieval with the softmax of the selected scores as weights.

  Args:
    scores: [..., memory_chunks], -inf where a chunk may not be retrieved.
    top_k: chunks per query (k >= 1; at most memory_chunks).
    gumbel_rng: a PRNG key to add Gumbel(0, 1) noise before the top-k (training), or
      None (evaluation and decoding: the plain top-k). The noise chooses the chunks only:
      the weights use the noise-free scores.

  Returns:
    (indices int32 [..., top_k], weights float32 [..., top_k]). Slots that found no
    retrievable chunk (fewer than k earlier chunks) have weight 0 and index 0. Ties are
    broken toward the lower chunk index (lax.top_k is stable).
  """
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
    raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
  if top_k > scores.shape[-1]:
    raise ValueError(f"top_k ({top_k}) exceeds the {scores.shape[-1]} memory chunks; use min(top_k, chunks)")
  scores = scores.astype(jnp.float32)
  noisy = scores
  if gumbel_rng is not None:
    noisy = scores + jax.random.gumbel(gumbel_rng, scores.shape, jnp.float32)
  _, indices = jax.lax.top_k(jax.lax.stop_gradient(noisy), top_k)
  selected = jnp.take_along_axis(scores, indices, axis=-1)
  valid = jnp.isfinite(selected)
  indices = jnp.where(valid, indices, 0)
  finite = jnp.where(valid, selected, 0.0)
  top = jnp.max(jnp.where(valid, selected, -jnp.inf), axis=-1, keepdims=True)
  top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
  exp = jnp.where(valid, jnp.exp(finite - top), 0.0)
  total = jnp.sum(exp, axis=-1, keepdims=True)
  weights = exp / jnp.where(total > 0, total, 1.0)
  return indices.astype(jnp.int32), weights
