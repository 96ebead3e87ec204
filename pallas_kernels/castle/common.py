"""What the CASTLE Triton and Mosaic GPU paths share outside their kernels, in XLA: the
in-block lookahead scores R (and the fold of their gradient into dQ^C and dV^U), and the
per-row softmax shift with its overflow rerun."""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

# SiLU(x) >= -0.2785 for every x, so A[t, s] <= S^C[t, s] + 0.2785.
_SILU_MIN = 0.27846454276
# Shifts keep exponents within float32 range: exp(80) ~ 5.5e34 leaves room for sums of
# up to ~6000x that many terms before the float32 maximum.
_EXPONENT_HEADROOM = 80.0


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def in_block_scores(q_c: jax.Array, v_u: jax.Array, scale: float, block_q: int) -> jax.Array:
  """R_ii = Q^C_i V^U_i^T * scale under the causal mask, per query block.

  Args:
    q_c, v_u: [BH, L, D], L a multiple of block_q.

  Returns:
    float32 [BH, L, block_q]; rows of block i hold R_ii.
  """
  heads, length, head_dim = q_c.shape
  blocks = lambda x: x.reshape(heads, length // block_q, block_q, head_dim)
  scores = (
    jnp.einsum(
      "bntd,bnjd->bntj", blocks(q_c), blocks(v_u), preferred_element_type=jnp.float32, precision=_precision(q_c.dtype)
    )
    * scale
  )
  causal = jnp.arange(block_q)[:, None] >= jnp.arange(block_q)[None, :]
  return jnp.where(causal, scores, 0.0).reshape(heads, length, block_q)


def fold_in_block_grad(dq_c, dv_u, d_in_block, q_c, v_u, scale: float, block_q: int):
  """dQ^C and dV^U plus their shares of the in-block scores' gradient.

  R_ii = Q^C_i V^U_i^T * scale under the causal mask (`in_block_scores`): a backward
  kernel returns dL/dR_ii unmasked and unscaled, and it goes to Q^C and V^U here.

  Args:
    dq_c, dv_u: float32 [BH, L, D], the kernel's gradients without R's share.
    d_in_block: float32 [BH, L, block_q]; rows of query block i hold dL/dR_ii.
    q_c, v_u: [BH, L, D], the inputs.

  Returns:
    (dq_c, dv_u), float32 [BH, L, D].
  """
  heads, length, _ = q_c.shape
  blocks = lambda x: x.reshape(heads, length // block_q, block_q, x.shape[-1])
  causal = jnp.arange(block_q)[:, None] >= jnp.arange(block_q)[None, :]
  d_in_block = jnp.where(causal, blocks(d_in_block), 0.0) * scale
  precision = _precision(jnp.float32)
  dq_c = dq_c + jnp.einsum("bntj,bnjd->bntd", d_in_block, blocks(v_u.astype(jnp.float32)), precision=precision).reshape(
    dq_c.shape
  )
  dv_u = dv_u + jnp.einsum("bntj,bntd->bnjd", d_in_block, blocks(q_c.astype(jnp.float32)), precision=precision).reshape(
    dv_u.shape
  )
  return dq_c, dv_u


def _diagonal_scores(q_c: jax.Array, k_c: jax.Array, scale: float) -> jax.Array:
  """float32 [BH, L]: S^C[t, t], whose term in the softmax sum is exp(0) after the shift."""
  return jnp.sum(q_c.astype(jnp.float32) * k_c.astype(jnp.float32), axis=-1) * scale


def _max_causal_scores(q_c: jax.Array, k_c: jax.Array, scale: float, block: int) -> jax.Array:
  """float32 [BH, L]: max_{s <= t} S^C[t, s], one query block at a time (memory O(L * block))."""
  heads, length, head_dim = q_c.shape
  key_positions = jnp.arange(length)

  def block_max(start):
    q = lax.dynamic_slice_in_dim(q_c, start, block, axis=1)
    scores = (
      jnp.einsum("btd,bsd->bts", q, k_c, preferred_element_type=jnp.float32, precision=_precision(q_c.dtype)) * scale
    )
    visible = (start + jnp.arange(block))[:, None] >= key_positions[None, :]
    return jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1)

  maxima = lax.map(block_max, jnp.arange(0, length, block))  # [L / block, BH, block]
  return maxima.transpose(1, 0, 2).reshape(heads, length)


def normalize_with_safe_shift(run, q_c: jax.Array, k_c: jax.Array, scale: float, block_q: int):
  """A forward kernel's output, normalized, with its per-row shift chosen safely.

  `run(shift=...)` -> (unnormalized output, row sums, final D) of a forward kernel that
  exponentiates scores minus a per-row shift. It runs shifted by each row's diagonal
  score and, only if a sum or an output overflowed, again shifted by the row maximum. The
  output overflows first: a score ~87 above the diagonal one gives a finite weight near
  float32's maximum, and that weight times a value of norm > 1 does not fit.

  Returns out (float32 [BH, L, D]), lse (float32 [BH, L]) and the final D.
  """
  diagonal = _diagonal_scores(q_c, k_c, scale)
  acc, sums, keys = run(shift=diagonal)

  def rerun_with_row_max(_):
    # Some score was far enough above its row's diagonal score that exp or a weighted
    # value overflowed: shift by the row maximum instead, but never so far that the
    # diagonal term underflows.
    row_max = _max_causal_scores(q_c, k_c, scale, block_q) + _SILU_MIN
    shift = jnp.maximum(diagonal, row_max - _EXPONENT_HEADROOM)
    return run(shift=shift) + (shift,)

  overflowed = jnp.logical_not(jnp.all(jnp.isfinite(sums)) & jnp.all(jnp.isfinite(acc)))
  acc, sums, keys, shift = lax.cond(overflowed, rerun_with_row_max, lambda _: (acc, sums, keys, diagonal), None)
  return acc / sums[..., None], shift + jnp.log(sums), keys
