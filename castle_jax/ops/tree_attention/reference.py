"""Tree attention straight from its definition: one softmax over every key a drafted
node may see (a test oracle, and the "reference" implementation).

Query i (a drafted node) sees the committed cache slots s < cache_length and the
drafted nodes its tree mask allows (itself and its ancestors). With scores
z = q_i . k / sqrt(head_dim) over those keys,
    lse_i = log sum exp(z),    out_i = sum exp(z - lse_i) v,
per head, with grouped-query heads (query head h reads kv head h // (heads // kv_heads)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from castle_jax.ops.attention.reference import masked_attention
from castle_jax.ops.numerics import score_scale


def lengths_per_row(cache_length: jax.Array, batch: int) -> jax.Array:
  """int32 [batch]: the filled cache slots of each row (a scalar applies to every row)."""
  return jnp.broadcast_to(jnp.asarray(cache_length, jnp.int32), (batch,))


def filled_slots(cache_length: jax.Array, batch: int, capacity: int) -> jax.Array:
  """bool [batch, capacity]: True for the slots below each row's cache length."""
  return jnp.arange(capacity)[None, :] < lengths_per_row(cache_length, batch)[:, None]


def dense_attention_with_lse(
  q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Masked softmax attention and its log-sum-exp, in float32.

  Args:
    q: [batch, q_len, heads, head_dim].
    k, v: [batch, k_len, kv_heads, head_dim]; heads % kv_heads == 0.
    visible: bool [batch, q_len, k_len]; True where the query may attend.

  Returns:
    out: [batch, q_len, heads, head_dim] in q's dtype (0 for a row that sees nothing);
    lse: float32 [batch, q_len, heads], log sum exp of the visible scaled scores
      (-inf for a row that sees nothing).
  """
  batch, q_len, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  out = masked_attention(q, k, v, visible)
  grouped_q = q.reshape(batch, q_len, kv_heads, heads // kv_heads, head_dim).astype(jnp.float32)
  scores = jnp.einsum("bqhgd,bkhd->bqhgk", grouped_q, k.astype(jnp.float32), precision="highest") * score_scale(
    head_dim
  )
  scores = jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)
  lse = jax.nn.logsumexp(scores, axis=-1).reshape(batch, q_len, heads)
  return out, lse


def cache_attention_reference(
  q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Attention of the queries over the first `length` slots of a cache, no other mask.

  Args:
    q: [batch, n, heads, head_dim].
    k, v: [batch, capacity, kv_heads, head_dim]; slots >= length are ignored.
    length: int32 scalar or [batch], filled slots per row (0 .. capacity).

  Returns:
    out [batch, n, heads, head_dim] in q's dtype (0 for an empty cache) and
    lse float32 [batch, n, heads] (-inf for an empty cache).
  """
  batch, n = q.shape[:2]
  visible = jnp.broadcast_to(filled_slots(length, batch, k.shape[1])[:, None, :], (batch, n, k.shape[1]))
  return dense_attention_with_lse(q, k, v, visible)


def tree_attention_reference(
  q: jax.Array,
  cache_k: jax.Array,
  cache_v: jax.Array,
  cache_length: jax.Array,
  tree_k: jax.Array,
  tree_v: jax.Array,
  tree_mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """One softmax over [cache slots ; tree nodes] with visibility [slot < cache_length ; tree_mask].

  Args:
    q: [batch, n, heads, head_dim], the drafted nodes' queries.
    cache_k, cache_v: [batch, capacity, kv_heads, head_dim], the committed cache.
    cache_length: int32 scalar or [batch], filled cache slots (may be traced).
    tree_k, tree_v: [batch, n, kv_heads, head_dim], the drafted nodes' keys and values.
    tree_mask: bool [batch, n, n] or [n, n]; [i, j] True iff node i sees node j.

  Returns:
    out [batch, n, heads, head_dim] in q's dtype and lse float32 [batch, n, heads].
  """
  batch, n = q.shape[:2]
  capacity = cache_k.shape[1]
  cache_visible = jnp.broadcast_to(filled_slots(cache_length, batch, capacity)[:, None, :], (batch, n, capacity))
  visible = jnp.concatenate([cache_visible, jnp.broadcast_to(tree_mask, (batch, n, n))], axis=-1)
  keys = jnp.concatenate([cache_k, tree_k], axis=1)  # promotes mixed dtypes, losing nothing
  values = jnp.concatenate([cache_v, tree_v], axis=1)
  return dense_attention_with_lse(q, keys, values, visible)
