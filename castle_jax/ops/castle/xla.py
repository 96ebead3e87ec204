"""CASTLE in O(L^2 d) time and O(L d) memory: Algorithms 1 and 3 of the paper in XLA.

The sequence is cut into N blocks of `block_size` tokens. Score tile (i, j), i >= j,
pairs query block i with key block j. Following the paper's parallel scheme
(Fig. 9), a `lax.scan` walks the block diagonals k = i - j = 0, 1, ..., N-1 and
handles all N - k tiles of a diagonal at once, batched over the key block j (the
slots j with j + k >= N are masked out).

The L x L matrix S^U of Eq. (10) is never formed. Its masked low-rank structure gives,
for i > j (Eqs. 24-28),

  S^U[T_i, T_j] = Q^C_i D_j^T / sqrt(d)  +  (Q^C_i V^U_i^T / sqrt(d) * M~^C_ii) sigmoid_ji^T,

with sigmoid_ji = sigmoid(Q^U_j K^U_i^T / sqrt(d) + M^U_ji), where
D_j = sum_{j <= i' < i} sigmoid_ji' V^U_i' is the running auxiliary of Eq. (25), stored
transposed ([block, d]). Row s of D_j is the lookahead key u_s of token s accumulated
over key blocks j .. i-1: prefilling reads the lookahead keys off it.

The first step (k = 0) runs the same code as the others: its D update reads key block
j - 1, which lies before every query of block j and is therefore fully masked.
Under CASTLE-SWL the diagonals beyond the window's reach run a second scan without
any sigmoid tile: there D is final and S^U is the low-rank term alone.

Memory: the forward keeps the online-softmax state and D ([L, d] each) and, per
step, one [block, block] tile per diagonal slot, N * block^2 = L * block numbers. The
custom VJP (Algorithm 3) saves only the inputs, the output, the row log-sum-exp and
the final D, and walks the diagonals backwards, recomputing each tile and turning
D^(k) back into D^(k-1) by subtracting the step's update (Eq. 37).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import math_dtype, score_scale
from castle_jax.ops.castle.common import (
  combined_scores,
  lookahead_visible,
  masked_sigmoid,
  silu_derivative,
  validate_block_size,
  validate_inputs,
)
from pallas_kernels.residuals import keep_for_backward

DEFAULT_BLOCK_SIZE = 64


# ---------------------------------------------------------------------------
# Block bookkeeping. Single-head arrays are blocked as [num_blocks, block, head_dim].


def _blocks_from(x: jax.Array, offset) -> jax.Array:
  """y[j] = x[(j + offset) mod num_blocks] along the block axis.

  Diagonal k pairs key block j with query block j + k, so row-indexed quantities are
  read with offset k and their updates written back with offset -k.
  """
  return jnp.roll(x, -offset, axis=0)


def _token_positions(block_index: jax.Array, block_size: int) -> jax.Array:
  """int [num_blocks, block]: positions of the tokens of each (possibly out-of-range) block."""
  return block_index[:, None] * block_size + jnp.arange(block_size)


def _lookahead_weight_tiles(
  q_u: jax.Array,
  k_u: jax.Array,
  query_blocks: jax.Array,
  key_blocks: jax.Array,
  window: int | None,
  last_position=None,
) -> jax.Array:
  """sigmoid(Q^U K^U^T / sqrt(d) + M^U) per slot.

  Args:
    q_u: [slots, block, d] lookahead queries of blocks `query_blocks`.
    k_u: [slots, block, d] lookahead keys of blocks `key_blocks`.
    query_blocks, key_blocks: int [slots]; block indices used for the mask. Indices
      outside [0, num_blocks) give positions that the mask rejects as needed.
    window: None or the SWL window.
    last_position: optional bound j <= last_position on key positions.

  Returns:
    [slots, block, block] weights; masked entries are exactly zero.
  """
  block_size, head_dim = q_u.shape[-2:]
  logits = jnp.einsum("nsd,njd->nsj", q_u, k_u) * score_scale(head_dim)
  visible = lookahead_visible(
    _token_positions(query_blocks, block_size), _token_positions(key_blocks, block_size), window, last_position
  )
  return masked_sigmoid(logits, visible)


def _in_block_causal(block_size: int) -> jax.Array:
  """M~^C inside a diagonal block: the value v^U_j' reaches query t only for j' <= t."""
  return jnp.arange(block_size)[:, None] >= jnp.arange(block_size)[None, :]


class _Tiles(NamedTuple):
  """Score tiles of one diagonal, one [block, block] tile per key-block slot j."""

  scores: jax.Array  # A (Eq. 23), -inf where masked.
  lookahead_scores: jax.Array  # S^U tile (Eq. 28).
  lookahead_weights: jax.Array | None  # sigmoid_ji, rows: lookahead queries of block j.
  value_scores: jax.Array | None  # Q^C_i V^U_i^T / sqrt(d) * M~^C_ii.


def _lookahead_diagonals(num_blocks: int, block_size: int, window: int | None) -> int:
  """How many leading diagonals can see a nonzero lookahead weight.

  Diagonal k reads sigmoid tiles of query block j against key blocks j + k - 1 (the D
  update) and j + k (the in-block term). Key block j + o reaches a query of block j
  only if its first token is within the window of the block's last query:
  (o - 1) * block + 1 <= W. Past these diagonals D is final and
  S^U = Q^C D^T / sqrt(d), so CASTLE-SWL skips the sigmoid work there.
  """
  if window is None:
    return num_blocks
  return min(num_blocks, (window - 1) // block_size + 3)


def _diagonal_phases(num_blocks: int, block_size: int, window: int | None):
  """[(with_weights, diagonals)]: the diagonals that need sigmoid tiles, then the rest."""
  split = _lookahead_diagonals(num_blocks, block_size, window)
  phases = [(True, jnp.arange(split)), (False, jnp.arange(split, num_blocks))]
  return [(with_weights, diagonals) for with_weights, diagonals in phases if diagonals.size]


def _diagonal_tiles(
  diagonal,
  q_c_rows: jax.Array,
  k_c: jax.Array,
  q_u: jax.Array,
  k_u_rows: jax.Array,
  v_u_rows: jax.Array,
  partial_keys: jax.Array,
  window: int | None,
  with_weights: bool,
) -> _Tiles:
  """Recomputes the tiles (j + diagonal, j) for every key block j.

  Args:
    diagonal: int scalar k.
    q_c_rows, k_u_rows, v_u_rows: [N, block, d], blocks j + k (already rolled).
    k_c, q_u: [N, block, d], blocks j.
    partial_keys: [N, block, d], D_j^(k)^T.
    window: None or the SWL window.
    with_weights: False on diagonals where every lookahead weight is masked (static).
  """
  num_blocks, block_size, head_dim = q_c_rows.shape
  scale = score_scale(head_dim)
  key_blocks = jnp.arange(num_blocks)
  query_blocks = key_blocks + diagonal
  valid = query_blocks < num_blocks

  lookahead_scores = jnp.einsum("ntd,nsd->nts", q_c_rows, partial_keys) * scale
  lookahead_weights = value_scores = None
  if with_weights:
    lookahead_weights = _lookahead_weight_tiles(q_u, k_u_rows, key_blocks, query_blocks, window)
    value_scores = jnp.where(_in_block_causal(block_size), jnp.einsum("ntd,njd->ntj", q_c_rows, v_u_rows) * scale, 0.0)
    lookahead_scores += jnp.einsum("ntj,nsj->nts", value_scores, lookahead_weights)
  causal_scores = jnp.einsum("ntd,nsd->nts", q_c_rows, k_c) * scale
  query_positions = _token_positions(query_blocks, block_size)
  key_positions = _token_positions(key_blocks, block_size)
  visible = (query_positions[:, :, None] >= key_positions[:, None, :]) & valid[:, None, None]
  scores = jnp.where(visible, combined_scores(causal_scores, lookahead_scores), -jnp.inf)
  return _Tiles(scores, lookahead_scores, lookahead_weights, value_scores)


def _partial_key_update_weights(diagonal, q_u, k_u, window) -> tuple[jax.Array, jax.Array]:
  """sigmoid_j,(j+k-1) of Eq. (27) and the rolled key blocks it pairs with.

  Returns:
    weights: [N, block, block], zero in slots whose tile (j + k, j) does not exist.
    key_offset: the block offset k - 1 of the keys/values it multiplies.
  """
  num_blocks = q_u.shape[0]
  key_blocks = jnp.arange(num_blocks)
  key_offset = diagonal - 1
  weights = _lookahead_weight_tiles(q_u, _blocks_from(k_u, key_offset), key_blocks, key_blocks + key_offset, window)
  valid = key_blocks + diagonal < num_blocks
  return jnp.where(valid[:, None, None], weights, 0.0), key_offset


# ---------------------------------------------------------------------------
# Algorithm 1, one head.


def _forward_one_head(q_u, k_u, v_u, q_c, k_c, v_c, window):
  """Algorithm 1 on [N, block, d] arrays.

  Returns:
    out: [N, block, d]; lse: [N, block] row log-sum-exp of A; partial_keys:
    [N, block, d], the final D^T (lookahead keys summed over key blocks up to N - 2).
  """
  num_blocks, block_size, head_dim = q_c.shape
  dtype = q_c.dtype

  def step(carry, diagonal, with_weights):
    partial_keys, row_max, row_sum, acc = carry
    if with_weights:
      update_weights, key_offset = _partial_key_update_weights(diagonal, q_u, k_u, window)
      partial_keys = partial_keys + jnp.einsum("nsj,njd->nsd", update_weights, _blocks_from(v_u, key_offset))
    tiles = _diagonal_tiles(
      diagonal,
      _blocks_from(q_c, diagonal),
      k_c,
      q_u,
      _blocks_from(k_u, diagonal),
      _blocks_from(v_u, diagonal),
      partial_keys,
      window,
      with_weights,
    )

    # Online softmax (Algorithm 2) on the query rows j + k.
    old_max = _blocks_from(row_max, diagonal)
    new_max = jnp.maximum(old_max, jnp.max(tiles.scores, axis=-1))
    probs = jnp.exp(tiles.scores - new_max[..., None])
    correction = jnp.exp(old_max - new_max)
    new_sum = correction * _blocks_from(row_sum, diagonal) + jnp.sum(probs, axis=-1)
    new_acc = correction[..., None] * _blocks_from(acc, diagonal) + jnp.einsum("nts,nsd->ntd", probs, v_c)
    row_max, row_sum, acc = (_blocks_from(x, -diagonal) for x in (new_max, new_sum, new_acc))
    return (partial_keys, row_max, row_sum, acc), None

  carry = (
    jnp.zeros((num_blocks, block_size, head_dim), dtype),
    jnp.full((num_blocks, block_size), -jnp.inf, dtype),
    jnp.zeros((num_blocks, block_size), dtype),
    jnp.zeros((num_blocks, block_size, head_dim), dtype),
  )
  for with_weights, diagonals in _diagonal_phases(num_blocks, block_size, window):
    carry, _ = jax.lax.scan(functools.partial(step, with_weights=with_weights), carry, diagonals)
  partial_keys, row_max, row_sum, acc = carry
  # Every query sees at least its own token, so row_sum > 0.
  return acc / row_sum[..., None], row_max + jnp.log(row_sum), partial_keys


# ---------------------------------------------------------------------------
# Algorithm 3, one head.


def _backward_one_head(q_u, k_u, v_u, q_c, k_c, v_c, out, lse, partial_keys, d_out, window):
  """Algorithm 3 on [N, block, d] arrays: the gradients of the six inputs."""
  num_blocks = q_c.shape[0]
  scale = score_scale(q_c.shape[-1])
  delta = jnp.sum(d_out * out, axis=-1)  # Delta_t = dO_t . O_t

  def step(carry, diagonal, with_weights):
    (partial_keys, d_partial_keys, d_q_u, d_k_c, d_v_c, d_q_c, d_k_u, d_v_u) = carry
    q_c_rows, k_u_rows, v_u_rows, d_out_rows, lse_rows, delta_rows = (
      _blocks_from(x, diagonal) for x in (q_c, k_u, v_u, d_out, lse, delta)
    )
    tiles = _diagonal_tiles(diagonal, q_c_rows, k_c, q_u, k_u_rows, v_u_rows, partial_keys, window, with_weights)

    probs = jnp.exp(tiles.scores - lse_rows[..., None])  # P (Eq. 29), 0 where masked.
    d_probs = jnp.einsum("ntd,nsd->nts", d_out_rows, v_c)
    d_v_c = d_v_c + jnp.einsum("nts,ntd->nsd", probs, d_out_rows)
    d_scores = probs * (d_probs - delta_rows[..., None])  # dS^C (Eq. 32)
    d_lookahead = -silu_derivative(tiles.lookahead_scores) * d_scores  # dS^U (Eq. 33)

    # Through S^C = Q^C K^C^T / sqrt(d) and the low-rank term Q^C D^T / sqrt(d).
    d_q_c_rows = scale * (
      jnp.einsum("nts,nsd->ntd", d_scores, k_c) + jnp.einsum("nts,nsd->ntd", d_lookahead, partial_keys)
    )
    d_k_c = d_k_c + scale * jnp.einsum("nts,ntd->nsd", d_scores, q_c_rows)
    # After this, d_partial_keys holds dL/dD^(k): the sum over diagonals >= k reading D_j.
    d_partial_keys = d_partial_keys + scale * jnp.einsum("nts,ntd->nsd", d_lookahead, q_c_rows)

    if with_weights:
      # Through the in-block term value_scores sigmoid_ji^T of Eq. (28).
      d_value_scores = jnp.where(
        _in_block_causal(q_c.shape[1]), jnp.einsum("nts,nsj->ntj", d_lookahead, tiles.lookahead_weights), 0.0
      )
      d_lookahead_weights = jnp.einsum("nts,ntj->nsj", d_lookahead, tiles.value_scores)
      d_q_c_rows = d_q_c_rows + scale * jnp.einsum("ntj,njd->ntd", d_value_scores, v_u_rows)
      d_v_u_rows = scale * jnp.einsum("ntj,ntd->njd", d_value_scores, q_c_rows)

      # Through this step's D update (Eq. 27), then D^(k) back to D^(k-1) (Eq. 37).
      update_weights, key_offset = _partial_key_update_weights(diagonal, q_u, k_u, window)
      k_u_prev, v_u_prev = _blocks_from(k_u, key_offset), _blocks_from(v_u, key_offset)
      d_v_u_prev = jnp.einsum("nsj,nsd->njd", update_weights, d_partial_keys)
      d_update_weights = jnp.einsum("nsd,njd->nsj", d_partial_keys, v_u_prev)
      partial_keys = partial_keys - jnp.einsum("nsj,njd->nsd", update_weights, v_u_prev)

      # Through both sigmoids; masked entries have weight 0 and so zero derivative.
      d_logits = scale * d_lookahead_weights * tiles.lookahead_weights * (1.0 - tiles.lookahead_weights)
      d_logits_prev = scale * d_update_weights * update_weights * (1.0 - update_weights)
      d_q_u = d_q_u + (
        jnp.einsum("nsj,njd->nsd", d_logits, k_u_rows) + jnp.einsum("nsj,njd->nsd", d_logits_prev, k_u_prev)
      )
      d_k_u_rows = jnp.einsum("nsj,nsd->njd", d_logits, q_u)
      d_k_u_prev = jnp.einsum("nsj,nsd->njd", d_logits_prev, q_u)

      # Row-indexed gradients go back to blocks j + k and j + k - 1; slots without a
      # tile contribute zeros, so the wrapped-around rolls add nothing.
      d_k_u = d_k_u + _blocks_from(d_k_u_rows, -diagonal) + _blocks_from(d_k_u_prev, -key_offset)
      d_v_u = d_v_u + _blocks_from(d_v_u_rows, -diagonal) + _blocks_from(d_v_u_prev, -key_offset)
    d_q_c = d_q_c + _blocks_from(d_q_c_rows, -diagonal)
    return (partial_keys, d_partial_keys, d_q_u, d_k_c, d_v_c, d_q_c, d_k_u, d_v_u), None

  carry = (partial_keys,) + (jnp.zeros_like(q_c),) * 7
  for with_weights, diagonals in reversed(_diagonal_phases(num_blocks, q_c.shape[1], window)):
    carry, _ = jax.lax.scan(functools.partial(step, with_weights=with_weights), carry, diagonals, reverse=True)
  _, _, d_q_u, d_k_c, d_v_c, d_q_c, d_k_u, d_v_u = carry
  return d_q_u, d_k_u, d_v_u, d_q_c, d_k_c, d_v_c


# ---------------------------------------------------------------------------
# Batched over [batch * heads] with a custom VJP.


def _batched_forward(q_u, k_u, v_u, q_c, k_c, v_c, window):
  return jax.vmap(functools.partial(_forward_one_head, window=window))(q_u, k_u, v_u, q_c, k_c, v_c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _castle_blocked(q_u, k_u, v_u, q_c, k_c, v_c, window):
  """[batch * heads, N, block, d] inputs -> [batch * heads, N, block, d] outputs."""
  return _batched_forward(q_u, k_u, v_u, q_c, k_c, v_c, window)[0]


def _castle_blocked_fwd(q_u, k_u, v_u, q_c, k_c, v_c, window):
  out, lse, partial_keys = keep_for_backward(_batched_forward(q_u, k_u, v_u, q_c, k_c, v_c, window))
  # O(L d) residuals only: inputs, output, row log-sum-exp and the final D.
  return out, (q_u, k_u, v_u, q_c, k_c, v_c, out, lse, partial_keys)


def _castle_blocked_bwd(window, residuals, d_out):
  backward = functools.partial(_backward_one_head, window=window)
  return jax.vmap(backward)(*residuals, d_out)


_castle_blocked.defvjp(_castle_blocked_fwd, _castle_blocked_bwd)


def _to_blocks(x: jax.Array, block_size: int, dtype) -> jax.Array:
  """[B, T, H, D] -> [B * H, N, block, D], zero-padded at the end of the sequence.

  Padded tokens come after every real one, so the causal mask keeps them out of the
  real rows and zero lookahead values add nothing to real lookahead keys.
  """
  batch, seq, heads, head_dim = x.shape
  num_blocks = -(-seq // block_size)
  x = jnp.pad(x.astype(dtype), ((0, 0), (0, num_blocks * block_size - seq), (0, 0), (0, 0)))
  return x.transpose(0, 2, 1, 3).reshape(batch * heads, num_blocks, block_size, head_dim)


def _from_blocks(x: jax.Array, batch: int, seq: int, heads: int, dtype) -> jax.Array:
  """[B * H, N, block, D] -> [B, T, H, D], dropping the padding."""
  _, num_blocks, block_size, head_dim = x.shape
  x = x.reshape(batch, heads, num_blocks * block_size, head_dim).transpose(0, 2, 1, 3)
  return x[:, :seq].astype(dtype)


def _prepare(inputs, window, block_size):
  validate_inputs(inputs, window)
  validate_block_size(block_size)
  seq = inputs[0].shape[1]
  # Short sequences need no more than one block.
  block_size = min(block_size, seq)
  dtype = math_dtype(inputs[0].dtype)
  return tuple(_to_blocks(x, block_size, dtype) for x in inputs)


def castle_blockwise(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  window: int | None = None,
  block_size: int = DEFAULT_BLOCK_SIZE,
) -> jax.Array:
  """CASTLE attention by Algorithm 1, differentiable by Algorithm 3 (custom VJP).

  O(L^2 d) time; O(L d) activation memory for the backward pass. Any sequence length
  works: the sequence is zero-padded to a multiple of `block_size`. bf16/f16 inputs
  are computed in float32; the result has the inputs' dtype. Matmuls follow jax's
  default precision, which on recent GPUs means TF32 for float32 operands; wrap the
  call in `jax.default_matmul_precision("highest")` for full float32 accuracy.

  Args:
    q_u, k_u, v_u: [batch, seq, heads, head_dim] lookahead queries, keys, values.
    q_c, k_c, v_c: [batch, seq, heads, head_dim] causal queries, keys, values.
    window: None for CASTLE, W >= 1 for CASTLE-SWL (Eq. 8).
    block_size: tokens per block (static); capped at seq.

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  blocked = _prepare(inputs, window, block_size)
  batch, seq, heads, _ = q_c.shape
  return _from_blocks(_castle_blocked(*blocked, window), batch, seq, heads, q_c.dtype)


def castle_blockwise_prefill(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  window: int | None = None,
  block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[jax.Array, jax.Array]:
  """Algorithm 1's outputs together with the lookahead keys U^L of the whole prompt.

  Algorithm 5 computes U^L with a separate pass; here it comes almost for free: the
  forward's auxiliary D already holds every lookahead key summed over all key blocks
  but the last, so only the last key block is added.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, seq, heads, head_dim].
    window: None for CASTLE, W >= 1 for CASTLE-SWL.
    block_size: tokens per block (static); capped at seq.

  Returns:
    outputs: [batch, seq, heads, head_dim] in the inputs' dtype.
    lookahead_keys: [batch, seq, heads, head_dim] in the compute dtype (>= float32);
      row s is u_s^L.
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  blocked = _prepare(inputs, window, block_size)
  batch, seq, heads, _ = q_c.shape
  out, _, partial_keys = _batched_forward(*blocked, window)

  num_blocks = blocked[0].shape[1]
  last = num_blocks - 1

  def add_last_key_block(q_u_head, k_u_head, v_u_head, partial_keys_head):
    k_last = jnp.broadcast_to(k_u_head[last], k_u_head.shape)
    weights = _lookahead_weight_tiles(
      q_u_head, k_last, jnp.arange(num_blocks), jnp.full((num_blocks,), last), window, last_position=seq - 1
    )
    return partial_keys_head + jnp.einsum("nsj,jd->nsd", weights, v_u_head[last])

  keys = jax.vmap(add_last_key_block)(*blocked[:3], partial_keys)
  return (_from_blocks(out, batch, seq, heads, q_c.dtype), _from_blocks(keys, batch, seq, heads, keys.dtype))
