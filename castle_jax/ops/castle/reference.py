"""CASTLE oracles: the recurrent definition and the naive parallel form.

Both are plain jnp at full precision (float64 inputs stay float64), O(L^3), and meant
for tests on tiny sequences.

- `castle_recurrent`: Eqs. (2)-(7) taken literally. For every t it materializes the
  lookahead keys U^t, then combines causal and lookahead scores.
- `castle_parallel`: Theorem 1, Eqs. (10)-(11), with L x L matrices.

Layout [batch, seq, heads, head_dim] throughout; CASTLE-SWL via `window` (Eq. 8).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import math_dtype, score_scale
from castle_jax.ops.castle.common import (
  attend_with_lookahead_keys,
  combined_scores,
  lookahead_visible,
  masked_sigmoid,
  masked_softmax,
)

# The oracles must not lose digits to reduced-precision matmul passes on accelerators.
_PRECISION = jax.lax.Precision.HIGHEST


def _upcast(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  dtype = math_dtype(arrays[0].dtype)
  return tuple(x.astype(dtype) for x in arrays)


def lookahead_keys(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  num_tokens: int,
  *,
  window: int | None = None,
) -> jax.Array:
  """U^t of Eq. (2) after `num_tokens` tokens, computed from the definition.

  Args:
    q_u, k_u, v_u: [batch, seq, heads, head_dim] with seq >= num_tokens; only the
      first `num_tokens` positions are read.
    num_tokens: t, the number of tokens generated so far.
    window: None for CASTLE, W >= 1 for CASTLE-SWL.

  Returns:
    [batch, num_tokens, heads, head_dim] in the compute dtype (>= float32); row s is
    u_s^t. The last row is zero: token t has no successors yet.
  """
  q_u, k_u, v_u = _upcast(q_u[:, :num_tokens], k_u[:, :num_tokens], v_u[:, :num_tokens])
  positions = jnp.arange(num_tokens)
  # Slicing to the first t tokens already enforces j <= t of M^U_t.
  visible = lookahead_visible(positions, positions, window)
  scale = score_scale(q_u.shape[-1])
  logits = jnp.einsum("bshd,bjhd->bhsj", q_u, k_u, precision=_PRECISION) * scale
  weights = masked_sigmoid(logits, visible)
  return jnp.einsum("bhsj,bjhd->bshd", weights, v_u, precision=_PRECISION)


def castle_recurrent(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  window: int | None = None,
) -> jax.Array:
  """CASTLE from its recurrent definition, Eqs. (2)-(7); O(L^3 d), a test oracle.

  For each t: U^t = sigmoid(Q^U_t K^U_t^T / sqrt(d) + M^U_t) V^U_t,
  s^C_t = q^C_t K^C_t^T / sqrt(d), s^U_t = q^C_t U^t^T / sqrt(d),
  p_t = softmax(s^C_t - SiLU(s^U_t)), o_t = p_t V^C_t.

  Args:
    q_u, k_u, v_u: [batch, seq, heads, head_dim] lookahead queries, keys, values.
    q_c, k_c, v_c: [batch, seq, heads, head_dim] causal queries, keys, values.
    window: None for CASTLE, W >= 1 for CASTLE-SWL (Eq. 8).

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.
  """
  out_dtype = q_c.dtype
  q_c, k_c, v_c = _upcast(q_c, k_c, v_c)
  outputs = []
  for t in range(1, q_c.shape[1] + 1):
    keys_t = lookahead_keys(q_u, k_u, v_u, t, window=window)
    # The sliced keys are exactly tokens 1..t, so every one of them is visible.
    all_visible = jnp.ones((1, t), bool)
    outputs.append(
      attend_with_lookahead_keys(q_c[:, t - 1 : t], k_c[:, :t], v_c[:, :t], keys_t, all_visible, precision=_PRECISION)
    )
  return jnp.concatenate(outputs, axis=1).astype(out_dtype)


def lookahead_scores_parallel(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  *,
  window: int | None = None,
) -> jax.Array:
  """S^U of Eq. (10): (Q^C V^U^T / sqrt(d) * M~^C) sigmoid(Q^U K^U^T / sqrt(d) + M^U)^T.

  Args:
    q_u, k_u, v_u, q_c: [batch, seq, heads, head_dim], already in the compute dtype.
    window: None for CASTLE, W >= 1 for CASTLE-SWL.

  Returns:
    [batch, heads, seq, seq]; entry [t, s] is q^C_t . u_s^t / sqrt(d) for s <= t, 0 above
    the diagonal.
  """
  scale = score_scale(q_c.shape[-1])
  positions = jnp.arange(q_c.shape[1])
  causal = positions[:, None] >= positions[None, :]
  value_scores = jnp.einsum("bthd,bjhd->bhtj", q_c, v_u, precision=_PRECISION) * scale
  value_scores = jnp.where(causal, value_scores, 0.0)
  lookahead_logits = jnp.einsum("bshd,bjhd->bhsj", q_u, k_u, precision=_PRECISION) * scale
  lookahead_weights = masked_sigmoid(lookahead_logits, lookahead_visible(positions, positions, window))
  return jnp.einsum("bhtj,bhsj->bhts", value_scores, lookahead_weights, precision=_PRECISION)


def castle_parallel(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  window: int | None = None,
) -> jax.Array:
  """CASTLE in the parallel form of Theorem 1, Eqs. (10)-(11); O(L^3), a test oracle.

  Attention = row_softmax(Q^C K^C^T / sqrt(d) + M^C - SiLU(S^U)) V^C with S^U from
  `lookahead_scores_parallel`. Differentiable with plain autodiff.

  Args:
    q_u, k_u, v_u: [batch, seq, heads, head_dim] lookahead queries, keys, values.
    q_c, k_c, v_c: [batch, seq, heads, head_dim] causal queries, keys, values.
    window: None for CASTLE, W >= 1 for CASTLE-SWL (Eq. 8).

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.
  """
  out_dtype = q_c.dtype
  q_u, k_u, v_u, q_c, k_c, v_c = _upcast(q_u, k_u, v_u, q_c, k_c, v_c)
  positions = jnp.arange(q_c.shape[1])
  causal = positions[:, None] >= positions[None, :]
  lookahead = lookahead_scores_parallel(q_u, k_u, v_u, q_c, window=window)
  scale = score_scale(q_c.shape[-1])
  causal_scores = jnp.einsum("bthd,bshd->bhts", q_c, k_c, precision=_PRECISION) * scale
  weights = masked_softmax(combined_scores(causal_scores, lookahead), causal)
  return jnp.einsum("bhts,bshd->bthd", weights, v_c, precision=_PRECISION).astype(out_dtype)
