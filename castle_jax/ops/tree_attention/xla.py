"""Hybrid tree attention (LongSpec §3.3 and Appendix C): the "xla" implementation.

The keys a drafted node sees fall into two groups that need different masks:
  - the committed cache: every filled slot, the same for every query, no mask but the
    length. This is the long part, the one a flash-decoding kernel serves;
  - the drafted nodes themselves: a small n x n tree mask.
Each part gives an output normalized over its own keys and the log-sum-exp of its
scores. A softmax over the union of two key sets is the LSE-weighted mix of the
softmaxes over each set, so
    lse = logaddexp(lse_c, lse_s),    out = out_c exp(lse_c - lse) + out_s exp(lse_s - lse)
exactly (Appendix C). A part with no visible key (an empty cache) has lse -inf and
weight 0, so the merge returns the other part unchanged.

Shapes: q [batch, n, heads, head_dim]; keys/values [batch, keys, kv_heads, head_dim]
(heads % kv_heads == 0; query head h reads kv head h // (heads // kv_heads));
out [batch, n, heads, head_dim]; lse float32 [batch, n, heads], natural log, of the
scores q . k / sqrt(head_dim).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import score_scale
from castle_jax.ops.tree_attention.reference import filled_slots


def _partial_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax attention over one group of keys and its log-sum-exp, both float32.

  Args:
    q: [batch, n, heads, head_dim]; k, v: [batch, keys, kv_heads, head_dim].
    visible: bool [batch, n or 1, keys]; True where the query may attend.

  Returns:
    out float32 [batch, n, heads, head_dim] (0 for a row that sees nothing) and
    lse float32 [batch, n, heads] (-inf for a row that sees nothing).
  """
  batch, n, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  grouped_q = q.reshape(batch, n, kv_heads, heads // kv_heads, head_dim)
  # Products in the inputs' dtype with float32 accumulation: a bf16 cache is read as it
  # is rather than copied to float32 first.
  scores = jnp.einsum("bqhgd,bkhd->bqhgk", grouped_q, k, preferred_element_type=jnp.float32)
  scores = jnp.where(visible[:, :, None, None, :], scores * score_scale(head_dim), -jnp.inf)
  # `initial` keeps an empty key axis (a zero-capacity cache) legal.
  row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
  # A row that sees nothing has max -inf: shifting it by 0 keeps exp(-inf) = 0, not NaN.
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.exp(scores - row_max)
  total = jnp.sum(weights, axis=-1)
  out = jnp.einsum("bqhgk,bkhd->bqhgd", weights, v, preferred_element_type=jnp.float32)
  # Normalizing after the product (as flash attention does) divides n x d numbers, not n x keys.
  out = out / jnp.where(total > 0, total, 1.0)[..., None]
  lse = jnp.where(total > 0, row_max[..., 0] + jnp.log(total), -jnp.inf)
  return out.reshape(batch, n, heads, head_dim), lse.reshape(batch, n, heads)


def _cache_part(q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`cache_attention` with the output left in float32."""
  batch, capacity = k.shape[:2]
  filled = filled_slots(length, batch, capacity)
  # Empty slots may hold anything (a rejected draft, a donated buffer's leftovers): a
  # zero weight times a NaN value is still NaN, so their values are zeroed, not only
  # their scores masked.
  v = jnp.where(filled[:, :, None, None], v, jnp.zeros((), v.dtype))
  return _partial_attention(q, k, v, filled[:, None, :])


def _tree_part(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`masked_tree_attention` with the output left in float32."""
  batch, n = q.shape[:2]
  return _partial_attention(q, k, v, jnp.broadcast_to(mask, (batch, n, n)))


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Attention of n queries over the first `length` slots of a cache, with no other mask.

  Args:
    q: [batch, n, heads, head_dim].
    k, v: [batch, capacity, kv_heads, head_dim]; slots >= length are never read into
      the result, whatever they hold (NaN included).
    length: int32 scalar or [batch] (may be traced), filled slots per row, 0 .. capacity.

  Returns:
    out: [batch, n, heads, head_dim] in q's dtype; 0 for an empty cache.
    lse: float32 [batch, n, heads]; -inf for an empty cache.
  """
  out, lse = _cache_part(q, k, v, length)
  return out.astype(q.dtype), lse


def masked_tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Attention of the n drafted nodes over themselves under the tree mask.

  Args:
    q: [batch, n, heads, head_dim].
    k, v: [batch, n, kv_heads, head_dim], the drafted nodes' keys and values.
    mask: bool [batch, n, n] or [n, n]; [i, j] True iff node i sees node j
      (`tree_mask_from_parents`).

  Returns:
    out: [batch, n, heads, head_dim] in q's dtype (0 for a row that sees nothing).
    lse: float32 [batch, n, heads] (-inf for a row that sees nothing).
  """
  out, lse = _tree_part(q, k, v, mask)
  return out.astype(q.dtype), lse


def merge_attention(
  out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Attention over the union of two disjoint key sets, from the attention over each.

  Args:
    out_a, out_b: [..., heads, head_dim], each normalized over its own keys.
    lse_a, lse_b: float [..., heads], their log-sum-exps; -inf marks an empty part.

  Returns:
    out: [..., heads, head_dim] in the promoted dtype of out_a and out_b, mixed in
      float32; exactly the other part where one part is empty, 0 where both are.
    lse: float32 [..., heads], logaddexp(lse_a, lse_b).
  """
  lse_a = lse_a.astype(jnp.float32)
  lse_b = lse_b.astype(jnp.float32)
  lse = jnp.logaddexp(lse_a, lse_b)
  # Both parts empty: lse is -inf, and -inf - -inf would be NaN; shifting by 0 gives
  # both weights exp(-inf) = 0.
  shift = jnp.where(jnp.isfinite(lse), lse, 0.0)
  weight_a = jnp.exp(lse_a - shift)[..., None]
  weight_b = jnp.exp(lse_b - shift)[..., None]
  out = out_a.astype(jnp.float32) * weight_a + out_b.astype(jnp.float32) * weight_b
  return out.astype(jnp.result_type(out_a, out_b)), lse


def hybrid_tree_attention(
  q: jax.Array,
  cache_k: jax.Array,
  cache_v: jax.Array,
  cache_length: jax.Array,
  tree_k: jax.Array,
  tree_v: jax.Array,
  tree_mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Tree attention as cache part + tree part + merge (arguments as `tree_attention`).

  Both parts stay in float32 until the merge, so the output is rounded to q's dtype
  once.

  Returns:
    out [batch, n, heads, head_dim] in q's dtype and lse float32 [batch, n, heads].
  """
  cache_out, cache_lse = _cache_part(q, cache_k, cache_v, cache_length)
  tree_out, tree_lse = _tree_part(q, tree_k, tree_v, tree_mask)
  out, lse = merge_attention(cache_out, cache_lse, tree_out, tree_lse)
  return out.astype(q.dtype), lse
