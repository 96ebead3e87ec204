"""Plain-jnp softmax attention with an explicit mask: the oracle for every faster path.

Also the decode path: a handful of new queries against a fixed-capacity KV cache,
where the mask comes from positions rather than a fixed causal pattern.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask(q_positions: jax.Array, k_positions: jax.Array, window: int | None = None) -> jax.Array:
  """Which keys each query may see.

  Args:
    q_positions: int [batch, q_len], absolute position of each query.
    k_positions: int [batch, k_len], absolute position of each key; negative marks an
      empty cache slot.
    window: if set, a query at position i sees keys at positions i-window+1 .. i.

  Returns:
    bool [batch, q_len, k_len].
  """
  q = q_positions[:, :, None]
  k = k_positions[:, None, :]
  visible = (k <= q) & (k >= 0)
  if window is not None:
    visible &= k > q - window
  return visible


def masked_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
  """softmax(q k^T / sqrt(d) + bias, masked) v with grouped-query heads, computed in float32.

  Args:
    q: [batch, q_len, heads, head_dim].
    k, v: [batch, k_len, kv_heads, head_dim]; heads must be a multiple of kv_heads.
    mask: bool [batch, q_len, k_len]; True where the query may attend. Rows with no
      visible key produce zeros.
    bias: optional float [batch, heads, q_len, k_len] added to the scores (ALiBi).

  Returns:
    [batch, q_len, heads, head_dim] in q's dtype.
  """
  batch, q_len, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  group = heads // kv_heads
  qg = q.reshape(batch, q_len, kv_heads, group, head_dim).astype(jnp.float32)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32)) / jnp.sqrt(head_dim)
  if bias is not None:
    scores += bias.astype(jnp.float32).reshape(batch, kv_heads, group, *bias.shape[2:])
  mask = mask[:, None, None, :, :]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v.astype(jnp.float32))
  return out.reshape(batch, q_len, heads, head_dim).astype(q.dtype)
