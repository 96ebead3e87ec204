"""Pieces of the CASTLE math shared by the reference, blockwise and decoding paths.

Notation (paper, Sec. 2.2), per head, with 0-based positions and d = head_dim:
  lookahead key  u_s^t = sum_{j visible} sigmoid(q^U_s . k^U_j / sqrt(d)) v^U_j,
                 visible: s < j <= t (CASTLE, Eq. 3), additionally j <= s + W (SWL, Eq. 8);
  scores         a_t[s] = q^C_t . k^C_s / sqrt(d) - SiLU(q^C_t . u_s^t / sqrt(d)),  s <= t;
  output         o_t = softmax(a_t) V^C.
The lookahead score uses the causal query q^C_t, as in Theorem 1 and Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Sequence
import numbers

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import score_scale

INPUT_NAMES = ("q_u", "k_u", "v_u", "q_c", "k_c", "v_c")


def lookahead_visible(
  query_positions: jax.Array,
  key_positions: jax.Array,
  window: int | None = None,
  last_position: jax.Array | int | None = None,
) -> jax.Array:
  """The lookahead mask M^U (Eqs. 3 and 8) as booleans.

  Key j contributes to the lookahead key of token s iff s < j (<= s + window under
  CASTLE-SWL) and j <= last_position (the current time t of M^U_t).

  Args:
    query_positions: int [..., q_len], positions s of the lookahead queries.
    key_positions: int [..., k_len], positions j of the lookahead keys/values.
    window: None for CASTLE, W >= 1 for CASTLE-SWL.
    last_position: the current time t; None means no bound (t = end of sequence).

  Returns:
    bool [..., q_len, k_len].
  """
  s = query_positions[..., :, None]
  j = key_positions[..., None, :]
  visible = j > s
  if window is not None:
    visible &= j <= s + window
  if last_position is not None:
    visible &= j <= last_position
  return visible


def masked_sigmoid(logits: jax.Array, visible: jax.Array) -> jax.Array:
  """sigmoid(logits + M^U) with M^U in {0, -inf}, written as a select so that the
  masked entries are exact zeros with zero gradient."""
  return jnp.where(visible, jax.nn.sigmoid(logits), 0.0)


def combined_scores(causal_scores: jax.Array, lookahead_scores: jax.Array) -> jax.Array:
  """Eq. (6) before the softmax: s^C - SiLU(s^U)."""
  return causal_scores - jax.nn.silu(lookahead_scores)


def silu_derivative(x: jax.Array) -> jax.Array:
  """d SiLU(x) / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))."""
  sig = jax.nn.sigmoid(x)
  return sig * (1.0 + x * (1.0 - sig))


def masked_softmax(scores: jax.Array, visible: jax.Array) -> jax.Array:
  """Softmax over the last axis restricted to `visible` entries.

  Every row must see at least one entry (CASTLE rows always see their own token).
  """
  scores = jnp.where(visible, scores, -jnp.inf)
  return jax.nn.softmax(scores, axis=-1)


def attend_with_lookahead_keys(
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  lookahead_keys: jax.Array,
  visible: jax.Array,
  precision=None,
) -> jax.Array:
  """Eqs. (4)-(7): combines causal keys and materialized lookahead keys.

  Args:
    q_c: [batch, q_len, heads, head_dim] causal queries.
    k_c, v_c: [batch, k_len, heads, head_dim] causal keys and values.
    lookahead_keys: [batch, k_len, heads, head_dim], the rows u_s^t of U^t.
    visible: bool, broadcastable to [batch, heads, q_len, k_len]; which keys each
      query attends to.
    precision: matmul precision.

  Returns:
    [batch, q_len, heads, head_dim] in q_c's dtype.
  """
  scale = score_scale(q_c.shape[-1])
  causal = jnp.einsum("bqhd,bkhd->bhqk", q_c, k_c, precision=precision) * scale
  lookahead = jnp.einsum("bqhd,bkhd->bhqk", q_c, lookahead_keys, precision=precision) * scale
  weights = masked_softmax(combined_scores(causal, lookahead), visible)
  return jnp.einsum("bhqk,bkhd->bqhd", weights, v_c, precision=precision).astype(q_c.dtype)


def validate_window(window) -> None:
  if window is None:
    return
  if isinstance(window, bool) or not isinstance(window, numbers.Integral):
    raise ValueError(f"window must be None or an int >= 1, got {window!r}")
  if window < 1:
    raise ValueError(f"window must be None (full CASTLE) or >= 1 (CASTLE-SWL window size), got {window}")


def validate_block_size(block_size) -> None:
  if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
    raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")


def validate_inputs(inputs: Sequence[jax.Array], window) -> None:
  """Checks the six CASTLE projections and the window.

  Args:
    inputs: q_u, k_u, v_u, q_c, k_c, v_c, each [batch, seq, heads, head_dim].
    window: None or an int >= 1.

  Raises:
    ValueError naming the offending argument.
  """
  if len(inputs) != len(INPUT_NAMES):
    raise ValueError(f"expected the six inputs {INPUT_NAMES}, got {len(inputs)}")
  for name, x in zip(INPUT_NAMES, inputs):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
        f"{name} must have shape [batch, seq, heads, head_dim] (rank 4); got shape {getattr(x, 'shape', type(x))}"
      )
  first = inputs[0]
  for name, x in zip(INPUT_NAMES[1:], inputs[1:]):
    if x.shape != first.shape:
      raise ValueError(
        f"{name} has shape {x.shape} but q_u has shape {first.shape}; all six CASTLE inputs "
        "must share one shape [batch, seq, heads, head_dim]"
      )
    if x.dtype != first.dtype:
      raise ValueError(
        f"{name} has dtype {x.dtype} but q_u has dtype {first.dtype}; cast all six CASTLE inputs to one dtype"
      )
  if not jnp.issubdtype(first.dtype, jnp.floating):
    raise ValueError(f"CASTLE inputs must be floating point; q_u has dtype {first.dtype}")
  batch, seq, heads, head_dim = first.shape
  if head_dim < 1:
    raise ValueError(f"head_dim (last axis of q_u) must be > 0; got shape {first.shape}")
  if seq < 1 or batch < 1 or heads < 1:
    raise ValueError(f"batch, seq and heads must be >= 1; q_u has shape {first.shape}")
  validate_window(window)
