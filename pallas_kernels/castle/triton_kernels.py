"""CASTLE forward and backward Pallas (Triton) kernels, key-block major.

Arrays are [batch * heads, padded_len, padded_head_dim]; `padded_len` is a multiple
of every block size and `padded_head_dim` a power of two (zero padding changes no
dot product).

Why key-block major. The lookahead score of query t and key s is
S^U[t, s] = q^C_t . u_s^t / sqrt(d), where the lookahead key u_s^t keeps growing with
t. For a key block b and query block i (i after b),

  S^U[T_i, T_b] = Q^C_i D_b^(i)^T / sqrt(d) + R_ii W_bi^T,   D_b^(i+1) = D_b^(i) + W_bi V^U_i,

with W_bi = sigmoid(Q^U_b K^U_i^T / sqrt(d)) under the lookahead mask and
R_ii = Q^C_i V^U_i^T / sqrt(d) under the causal mask (Eqs. 24-28 of the paper). D
runs along the query direction, so one program per key block keeps its
[block_k, d] slice of D in registers while it sweeps the query blocks: nothing of D
goes through memory. The paper's schedule (one launch per block diagonal) writes
and re-reads D and the softmax state for every block pair instead.

The price is that a query row's softmax is spread over many programs. The forward
uses a fixed per-row shift m_t instead of a running maximum (softmax does not
depend on the shift), accumulates sum_s exp(A[t, s] - m_t) and the unnormalized
output with atomic adds, and normalizes afterwards. With m_t = q^C_t . k^C_t / sqrt(d)
(the diagonal score, whose term is exp(0) = 1 because u_t^t = 0) the sum is >= 1,
so nothing underflows to 0/0; an overflow (a score more than ~80 above the
diagonal one) is detected by the caller, which reruns with a shift taken from the
row maximum. The backward sweeps the query blocks in reverse, turns D^(i+1) back
into D^(i) by subtracting W_bi V^U_i, carries dD (Algorithm 3) and the key-block
gradients dK^C, dV^C, dQ^U in registers, and adds the query-block gradients dQ^C,
dK^U, dV^U and the gradient of the in-block term R with atomics.

CASTLE-SWL: W_bi vanishes once every query of block i is more than `window` tokens
past the key block; from there on D is final, and both kernels run a second loop
without the lookahead-weight work.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from pallas_kernels.castle.config import CastleTritonConfig
from pallas_kernels.triton_atomics import relaxed_atomic_add


_FLOAT16_KEY_STATE_SCALE = 2.0**-8


def sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def silu(x):
  return x * sigmoid(x)


def _silu_grad(x):
  sig = sigmoid(x)
  return sig * (1.0 + x * (1.0 - sig))


class _Tiles:
  """Matmuls and masks shared by both kernels, for one (key block, head) program."""

  def __init__(
    self,
    *,
    operand_dtype,
    scale: float,
    window: int | None,
    block_q: int,
    key_positions: jax.Array,
  ):
    self.operand_dtype = operand_dtype
    # 16-bit inputs: the lookahead branch's float32 intermediates enter float16 products.
    self.float16_lookahead = operand_dtype != jnp.float32
    # D is a sum of up to L weighted values: scaled into float16's range when it enters a
    # float16 product (a power of two, so exact), and scaled back after.
    self.key_state_scale = _FLOAT16_KEY_STATE_SCALE if self.float16_lookahead else 1.0
    # float32 operands: full-precision products (no TF32), to match the references.
    self.precision = lax.Precision.HIGHEST if operand_dtype == jnp.float32 else None
    self.scale = scale
    self.window = window
    self.block_q = block_q
    self.key_positions = key_positions

  def dot(self, a, b, trans_a=False, trans_b=False):
    """a @ b in float32 from operands cast to the operand dtype."""
    return pltriton.dot(
      a.astype(self.operand_dtype),
      b.astype(self.operand_dtype),
      trans_a=trans_a,
      trans_b=trans_b,
      precision=self.precision,
    )

  def dot_lookahead(self, a, b, trans_a=False, trans_b=False, wide_a=False, wide_b=False):
    """Like `dot` for products that take float32 intermediates of the lookahead branch
    (D, R, W; marked wide): with 16-bit inputs both operands enter as float16 (11
    significant bits; bfloat16 would keep 8)."""
    if not (self.float16_lookahead and (wide_a or wide_b)):
      return self.dot(a, b, trans_a, trans_b)
    return pltriton.dot(a.astype(jnp.float16), b.astype(jnp.float16), trans_a=trans_a, trans_b=trans_b)

  def lookahead_scores(self, q_c, keys, in_block=None, weights=None):
    """S^U tile [block_q, block_k]: Q^C_i D_b^T * scale, plus R_ii W_bi^T inside the window."""
    key_scale = self.key_state_scale
    if key_scale != 1.0:
      keys = keys * key_scale
    scores = self.dot_lookahead(q_c, keys, trans_b=True, wide_b=True) * (self.scale / key_scale)
    if weights is not None:
      scores += self.dot_lookahead(in_block, weights, trans_b=True, wide_a=True, wide_b=True)
    return scores

  def probabilities(self, q_c, k_c, lookahead_scores, shift, query_positions):
    """exp(S^C - SiLU(S^U) - shift) under the causal mask, [block_q, block_k]."""
    scores = self.dot(q_c, k_c, trans_b=True) * self.scale - silu(lookahead_scores)
    return jnp.where(self.causal_visible(query_positions), jnp.exp(scores - shift[:, None]), 0.0)

  def key_state_step(self, weights, v_u):
    """W_bi V^U_i, D's step over one query block (Eq. 27); the backward subtracts exactly
    this value (same rounding) to walk D back."""
    return self.dot_lookahead(weights, v_u, wide_a=True)

  def query_positions(self, query_block):
    return query_block * self.block_q + jnp.arange(self.block_q)

  def causal_visible(self, query_positions):
    """[block_q, block_k]: key s is visible to query t iff s <= t."""
    return query_positions[:, None] >= self.key_positions[None, :]

  def lookahead_weights(self, q_u_keys, k_u_rows, query_positions):
    """W_bi: [block_k, block_q], sigmoid(q^U_s . k^U_j / sqrt(d)) for s < j (<= s + W), else 0."""
    logits = self.dot(q_u_keys, k_u_rows, trans_b=True) * self.scale
    s = self.key_positions[:, None]
    j = query_positions[None, :]
    visible = j > s
    if self.window is not None:
      visible &= j <= s + self.window
    return jnp.where(visible, sigmoid(logits), 0.0)


def _query_block_range(key_block, config_block_q: int, config_block_k: int, num_query_blocks: int, window: int | None):
  """(first, lookahead_end): the query blocks a key block meets, and the end of those
  that still meet a nonzero lookahead weight."""
  first = lax.div(key_block * config_block_k, config_block_q)
  if window is None:
    return first, num_query_blocks
  last_key = (key_block + 1) * config_block_k - 1
  lookahead_end = jnp.minimum(num_query_blocks, lax.div(last_key + window, config_block_q) + 1)
  return first, lookahead_end


def _block_specs(length: int, head_dim: int, block_q: int, block_k: int):
  """BlockSpecs of a (key block, batch * head) grid: the program's key tile [block_k, D],
  whole sequences [L, D] and [L] (swept block by block), and R's [L, block_q]."""
  return (
    pl.BlockSpec((None, block_k, head_dim), lambda kb, bh: (bh, kb, 0)),
    pl.BlockSpec((None, length, head_dim), lambda kb, bh: (bh, 0, 0)),
    pl.BlockSpec((None, length), lambda kb, bh: (bh, 0)),
    pl.BlockSpec((None, length, block_q), lambda kb, bh: (bh, 0, 0)),
  )


def _bind(kernel_body, q_c, scale, window, block_q, block_k):
  return functools.partial(
    kernel_body,
    scale=scale,
    window=window,
    block_q=block_q,
    block_k=block_k,
    num_query_blocks=q_c.shape[1] // block_q,
    operand_dtype=q_c.dtype,
  )


# ---------------------------------------------------------------------------
# Forward


def _forward_kernel(
  q_u_ref,
  k_c_ref,
  v_c_ref,
  q_c_ref,
  k_u_ref,
  v_u_ref,
  shift_ref,
  in_block_ref,
  _acc_in_ref,
  _sum_in_ref,
  keys_ref,
  acc_ref,
  sum_ref,
  *,
  scale,
  window,
  block_q,
  block_k,
  num_query_blocks,
  operand_dtype,
):
  key_block = pl.program_id(0)
  tiles = _Tiles(
    operand_dtype=operand_dtype,
    scale=scale,
    window=window,
    block_q=block_q,
    key_positions=key_block * block_k + jnp.arange(block_k),
  )
  q_u_keys, k_c, v_c = q_u_ref[...], k_c_ref[...], v_c_ref[...]  # this program's key block

  def step(query_block, keys, with_lookahead):
    rows = pl.ds(query_block * block_q, block_q)
    query_positions = tiles.query_positions(query_block)
    q_c = q_c_ref[rows, :]
    weights = in_block = None
    if with_lookahead:
      weights = tiles.lookahead_weights(q_u_keys, k_u_ref[rows, :], query_positions)
      in_block = in_block_ref[rows, :]
    lookahead_scores = tiles.lookahead_scores(q_c, keys, in_block, weights)
    probs = tiles.probabilities(q_c, k_c, lookahead_scores, shift_ref[rows], query_positions)
    relaxed_atomic_add(sum_ref, (rows,), jnp.sum(probs, axis=1))
    relaxed_atomic_add(acc_ref, (rows, slice(None)), tiles.dot(probs, v_c))
    if with_lookahead:
      keys = keys + tiles.key_state_step(weights, v_u_ref[rows, :])
    return keys

  first, lookahead_end = _query_block_range(key_block, block_q, block_k, num_query_blocks, window)
  keys = jnp.zeros(keys_ref.shape, jnp.float32)
  keys = lax.fori_loop(first, lookahead_end, functools.partial(step, with_lookahead=True), keys)
  if window is not None:
    keys = lax.fori_loop(lookahead_end, num_query_blocks, functools.partial(step, with_lookahead=False), keys)
  keys_ref[...] = keys


def forward(
  q_u,
  k_u,
  v_u,
  q_c,
  k_c,
  v_c,
  shift,
  in_block,
  *,
  scale: float,
  window: int | None,
  config: CastleTritonConfig,
  interpret: bool,
):
  """The forward kernel on padded [BH, L, D] arrays.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [BH, L, D] in the operand dtype; L a multiple of
      config.block_q and config.block_k.
    shift: float32 [BH, L], the per-row softmax shift m_t.
    in_block: float32 [BH, L, block_q], R_ii of each query block (causally masked).
    scale: the score scale 1/sqrt(head_dim) of the unpadded head dim.
    window: None or the CASTLE-SWL window.

  Returns:
    acc: float32 [BH, L, D], sum_s exp(A - m_t) v^C_s; sums: float32 [BH, L],
    sum_s exp(A - m_t); keys: float32 [BH, L, D], D after the last query block,
    i.e. the lookahead keys u_s^L.
  """
  heads, length, head_dim = q_c.shape
  block_q, block_k = config.block_q, config.block_k
  key_tile, full, full_rows, full_in_block = _block_specs(length, head_dim, block_q, block_k)
  kernel = _bind(_forward_kernel, q_c, scale, window, block_q, block_k)
  acc = jnp.zeros((heads, length, head_dim), jnp.float32)
  sums = jnp.zeros((heads, length), jnp.float32)
  keys, acc, sums = pl.pallas_call(
    kernel,
    grid=(length // block_k, heads),
    in_specs=[key_tile, key_tile, key_tile, full, full, full, full_rows, full_in_block, full, full_rows],
    out_specs=[key_tile, full, full_rows],
    out_shape=[
      jax.ShapeDtypeStruct((heads, length, head_dim), jnp.float32),
      jax.ShapeDtypeStruct(acc.shape, acc.dtype),
      jax.ShapeDtypeStruct(sums.shape, sums.dtype),
    ],
    input_output_aliases={8: 1, 9: 2},
    compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name="castle_forward",
  )(q_u, k_c, v_c, q_c, k_u, v_u, shift, in_block, acc, sums)
  return acc, sums, keys


# ---------------------------------------------------------------------------
# Backward


def _backward_kernel(
  q_u_ref,
  k_c_ref,
  v_c_ref,
  keys_final_ref,
  q_c_ref,
  k_u_ref,
  v_u_ref,
  d_out_ref,
  lse_ref,
  delta_ref,
  in_block_ref,
  _dq_c_in,
  _dk_u_in,
  _dv_u_in,
  _d_in_block_in,
  dq_u_ref,
  dk_c_ref,
  dv_c_ref,
  dq_c_ref,
  dk_u_ref,
  dv_u_ref,
  d_in_block_ref,
  *,
  scale,
  window,
  block_q,
  block_k,
  num_query_blocks,
  operand_dtype,
):
  key_block = pl.program_id(0)
  tiles = _Tiles(
    operand_dtype=operand_dtype,
    scale=scale,
    window=window,
    block_q=block_q,
    key_positions=key_block * block_k + jnp.arange(block_k),
  )
  q_u_keys, k_c, v_c = q_u_ref[...], k_c_ref[...], v_c_ref[...]  # this program's key block

  def step(query_block, carry, with_lookahead):
    keys, d_keys, dq_u, dk_c, dv_c = carry
    rows = pl.ds(query_block * block_q, block_q)
    query_positions = tiles.query_positions(query_block)
    q_c = q_c_ref[rows, :]
    d_out = d_out_ref[rows, :]
    weights = in_block = None
    if with_lookahead:
      k_u = k_u_ref[rows, :]
      v_u = v_u_ref[rows, :]
      in_block = in_block_ref[rows, :]
      weights = tiles.lookahead_weights(q_u_keys, k_u, query_positions)
      keys = keys - tiles.key_state_step(weights, v_u)  # D^(i+1) -> D^(i) (Eq. 37)

    # Recompute the tile's scores and probabilities.
    lookahead_scores = tiles.lookahead_scores(q_c, keys, in_block, weights)
    probs = tiles.probabilities(q_c, k_c, lookahead_scores, lse_ref[rows], query_positions)

    # Softmax and the causal branch, as in flash attention.
    dv_c = dv_c + tiles.dot(probs, d_out, trans_a=True)
    d_probs = tiles.dot(d_out, v_c, trans_b=True)
    d_scores = probs * (d_probs - delta_ref[rows][:, None])
    d_lookahead = -d_scores * _silu_grad(lookahead_scores)
    dk_c = dk_c + tiles.dot(d_scores, q_c, trans_a=True) * scale
    dq_c = (tiles.dot(d_scores, k_c) + tiles.dot(d_lookahead, keys)) * scale
    relaxed_atomic_add(dq_c_ref, (rows, slice(None)), dq_c)

    if with_lookahead:
      # The in-block term R_ii W_bi^T, and W_bi's share in D^(i') for i' > i via dD.
      relaxed_atomic_add(d_in_block_ref, (rows, slice(None)), tiles.dot(d_lookahead, weights))
      d_weights = tiles.dot(d_lookahead, in_block, trans_a=True) + tiles.dot(d_keys, v_u, trans_b=True)
      relaxed_atomic_add(dv_u_ref, (rows, slice(None)), tiles.dot(weights, d_keys, trans_a=True))
    # After this, d_keys holds dL/dD^(i): what the tiles of query blocks >= i read from D.
    d_keys = d_keys + tiles.dot(d_lookahead, q_c, trans_a=True) * scale
    if with_lookahead:
      d_logits = d_weights * weights * (1.0 - weights) * scale
      dq_u = dq_u + tiles.dot(d_logits, k_u)
      relaxed_atomic_add(dk_u_ref, (rows, slice(None)), tiles.dot(d_logits, q_u_keys, trans_a=True))
    return keys, d_keys, dq_u, dk_c, dv_c

  def reverse(start, stop, with_lookahead, carry):
    def body(r, carry):
      return step(stop - 1 - r, carry, with_lookahead)

    return lax.fori_loop(0, stop - start, body, carry)

  first, lookahead_end = _query_block_range(key_block, block_q, block_k, num_query_blocks, window)
  zeros = jnp.zeros(dq_u_ref.shape, jnp.float32)
  carry = (keys_final_ref[...], zeros, zeros, zeros, zeros)
  if window is not None:
    carry = reverse(lookahead_end, num_query_blocks, False, carry)
  _, _, dq_u, dk_c, dv_c = reverse(first, lookahead_end, True, carry)
  dq_u_ref[...] = dq_u
  dk_c_ref[...] = dk_c
  dv_c_ref[...] = dv_c


def backward(
  q_u,
  k_u,
  v_u,
  q_c,
  k_c,
  v_c,
  keys_final,
  d_out,
  lse,
  delta,
  in_block,
  *,
  scale: float,
  window: int | None,
  config: CastleTritonConfig,
  interpret: bool,
):
  """The backward kernel on padded [BH, L, D] arrays.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [BH, L, D] in the operand dtype.
    keys_final: float32 [BH, L, D], the forward's final D.
    d_out: [BH, L, D] output cotangent in the operand dtype.
    lse: float32 [BH, L], the rows' log-sum-exp of A.
    delta: float32 [BH, L], rowsum(dO * O).
    in_block: float32 [BH, L, bwd_block_q], R_ii for bwd_block_q-sized query blocks.

  Returns:
    dq_u, dk_c, dv_c, dq_c, dk_u, dv_u: float32 [BH, L, D] (dq_c and dv_u without the
    in-block term's share), d_in_block: float32 [BH, L, bwd_block_q], dL/dR_ii.
  """
  heads, length, head_dim = q_c.shape
  block_q, block_k = config.bwd_block_q, config.bwd_block_k
  key_tile, full, full_rows, full_in_block = _block_specs(length, head_dim, block_q, block_k)
  kernel = _bind(_backward_kernel, q_c, scale, window, block_q, block_k)
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  full_grad = jnp.zeros((heads, length, head_dim), jnp.float32)
  in_block_grad = jnp.zeros((heads, length, block_q), jnp.float32)
  return tuple(
    pl.pallas_call(
      kernel,
      grid=(length // block_k, heads),
      in_specs=[
        key_tile,
        key_tile,
        key_tile,
        key_tile,
        full,
        full,
        full,
        full,
        full_rows,
        full_rows,
        full_in_block,
        full,
        full,
        full,
        full_in_block,
      ],
      out_specs=[key_tile, key_tile, key_tile, full, full, full, full_in_block],
      out_shape=[f32(full_grad.shape)] * 6 + [f32(in_block_grad.shape)],
      input_output_aliases={11: 3, 12: 4, 13: 5, 14: 6},
      compiler_params=pltriton.CompilerParams(num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages),
      interpret=interpret,
      name="castle_backward",
    )(
      q_u,
      k_c,
      v_c,
      keys_final,
      q_c,
      k_u,
      v_u,
      d_out,
      lse,
      delta,
      in_block,
      full_grad,
      full_grad,
      full_grad,
      in_block_grad,
    )
  )
