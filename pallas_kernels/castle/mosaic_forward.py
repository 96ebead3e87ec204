"""CASTLE forward as a Pallas Mosaic GPU (Hopper: wgmma + TMA) kernel, key-block major.

The math and the schedule are those of the Triton kernels (`pallas_kernels.castle.kernels`,
whose docstring derives them): one program per (key block b, batch * head) keeps the
key block's lookahead-key state D_b ([block_k, d], float32) in registers and sweeps
the query blocks i >= b. Per step, with every tile in the key-row frame
([block_k, block_q], keys down, queries across):

  W      = sigmoid(Q^U_b K^U_i^T * scale) under the lookahead mask      (wgmma, smem x smem)
  S^U^T  = D_b Q^C_i^T * scale + W R_ii^T                               (wgmma, regs x smem, twice)
  S^C^T  = K^C_b Q^C_i^T * scale                                        (wgmma, smem x smem)
  P^T    = exp(S^C^T - SiLU(S^U^T) - shift_i) under the causal mask
  out_i += P V^C_b,  sums_i += column sums of P^T                       (wgmma, smem^T x smem)
  D_b   += W V^U_i                                                      (wgmma, regs x smem)

Working transposed is what keeps D on chip: wgmma takes its left operand from
registers, so D (and W) enter the products straight from the accumulators.

The lookahead products take float16 operands (11 significant bits, like the Triton
kernels' default "float16" mode): W in [0, 1], the in-block scores R (precomputed in
XLA, [BH, L, block_q] float16, rows of block i holding R_ii^T), Q^C and V^U as float16
copies, and D scaled by 2^-8 on the way in so that sums of up to ~16M unit values stay
in range. The causal products take the inputs' dtype. bf16 inputs must stay within
float16's range (|x| < 65504) for the float16 copies.

A query row's softmax is spread over the programs of all key blocks before it: the
kernel uses a fixed per-row shift (the caller's), and adds each step's [block_q, d]
output tile and [block_q] sums into float32 accumulators in global memory, with a TMA
reduce-add on the GPU. GPU interpret mode has no TMA reduction but runs the grid one
program at a time, so there the kernel reads, adds and writes back instead.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.castle.mosaic_config import CastleMosaicConfig

# D enters a float16 product scaled by this power of two (exact), and the product is
# scaled back.
KEY_STATE_SCALE = 2.0 ** -8
LOOKAHEAD_DTYPE = jnp.float16
_SWIZZLE_BYTES = 128
# What each program loads once (its key block) and per step (a query block).
_KEY_TILES = ("q_u", "k_c", "v_c")
_QUERY_TILES = ("q_c", "q_c16", "k_u", "v_u16", "in_block_t", "shift")


def _operand_smem(shape, dtype):
  """Shared memory laid out for TMA and wgmma: 8-row tiles one 128-byte swizzle span wide."""
  span = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, span)),
                                              plgpu.SwizzleTransform(_SWIZZLE_BYTES)))


def _matmul(a, b, shape, init=None, *, init_in_place: bool = True):
  """init + a @ b with float32 accumulation in a wgmma accumulator of `shape`.

  With `init_in_place` the accumulator starts from `init` (no second register tile);
  GPU interpret mode cannot run a preinitialized accumulator, so there the product
  is added after.
  """
  if init is not None and init_in_place:
    return pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, a, b))(plgpu.ACC.init(init))

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]
  product = pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))
  return product if init is None else init + product


def _register_operand(x, staging_smem):
  """x as a wgmma left operand: from registers on the GPU; GPU interpret mode only
  multiplies shared-memory operands, so there x goes through `staging_smem`."""
  if staging_smem is None:
    return x
  staging_smem[...] = x
  plgpu.commit_smem()
  return staging_smem


def _sigmoid(x):
  return 1.0 / (1.0 + jnp.exp(-x))


def _forward_kernel(
    q_u_ref, k_c_ref, v_c_ref, q_c_ref, q_c16_ref, k_u_ref, v_u16_ref, in_block_t_ref, shift_ref,
    acc_ref, sums_ref,   # float32 accumulators in global memory (mutable inputs)
    keys_ref,            # output: the final D
    key_smem, query_smem, in_block_smem, shift_smem, probs_smem, out_smem, sums_smem, keys_smem,
    weights_staging, keys_staging,  # None on the GPU (see `_register_operand`)
    key_barrier, query_barrier, accumulate_barrier, *, scale: float, window: int | None, block_q: int, block_k: int, num_query_blocks: int,
    head_dim: int, interpreted: bool):
  matmul = functools.partial(_matmul, init_in_place=not interpreted)
  key_block = lax.axis_index("key_block")
  head = lax.axis_index("head")
  key_rows = pl.ds(key_block * block_k, block_k)
  q_u_smem, k_c_smem, v_c_smem = key_smem
  q_c_smem, q_c16_smem, k_u_smem, v_u16_smem = query_smem
  dtype = q_c_ref.dtype

  for src, dst in zip((q_u_ref, k_c_ref, v_c_ref), key_smem):
    plgpu.copy_gmem_to_smem(src.at[head, key_rows], dst, key_barrier)
  plgpu.barrier_wait(key_barrier)

  key_positions = key_block * block_k + plgpu.broadcasted_iota(
      jnp.int32, (block_k, block_q), 0, layout=plgpu.Layout.WGMMA)
  query_offsets = plgpu.broadcasted_iota(jnp.int32, (block_k, block_q), 1, layout=plgpu.Layout.WGMMA)

  def step(query_block, keys):
    rows = pl.ds(query_block * block_q, block_q)
    for src, dst in zip((q_c_ref, q_c16_ref, k_u_ref, v_u16_ref), query_smem):
      plgpu.copy_gmem_to_smem(src.at[head, rows], dst, query_barrier)
    plgpu.copy_gmem_to_smem(in_block_t_ref.at[head, rows], in_block_smem, query_barrier)
    plgpu.copy_gmem_to_smem(shift_ref.at[head, rows], shift_smem, query_barrier)
    plgpu.barrier_wait(query_barrier)
    query_positions = query_block * block_q + query_offsets

    # W: lookahead weights of this key block's tokens s against query-block keys j.
    logits = matmul(q_u_smem, k_u_smem.T, (block_k, block_q)) * scale
    visible = query_positions > key_positions
    if window is not None:
      visible &= query_positions <= key_positions + window
    weights = jnp.where(visible, _sigmoid(logits), 0.0)
    weights16 = _register_operand(weights.astype(LOOKAHEAD_DTYPE), weights_staging)

    # S^U^T = D Q^C^T * scale + W R^T.
    keys16 = _register_operand((keys * KEY_STATE_SCALE).astype(LOOKAHEAD_DTYPE), keys_staging)
    lookahead = matmul(keys16, q_c16_smem.T, (block_k, block_q)) * (scale / KEY_STATE_SCALE)
    lookahead = matmul(weights16, in_block_smem, (block_k, block_q), init=lookahead)

    causal = matmul(k_c_smem, q_c_smem.T, (block_k, block_q)) * scale
    shift = lax.broadcast_in_dim(shift_smem[...], (block_k, block_q), [1])
    scores = causal - lookahead * _sigmoid(lookahead) - shift
    probs = jnp.where(query_positions >= key_positions, jnp.exp(scores), 0.0)

    probs_smem[...] = probs.astype(dtype)
    plgpu.commit_smem()
    out = matmul(probs_smem.T, v_c_smem, (block_q, head_dim))
    _accumulate(out, jnp.sum(probs, axis=0), acc_ref.at[head, rows], sums_ref.at[head, rows],
                out_smem, sums_smem, accumulate_barrier, with_tma=not interpreted)

    return matmul(weights16, v_u16_smem, (block_k, head_dim), init=keys)

  first = lax.div(key_block * block_k, block_q)
  keys = plgpu.layout_cast(jnp.zeros((block_k, head_dim), jnp.float32), plgpu.Layout.WGMMA)
  keys = lax.fori_loop(first, num_query_blocks, step, keys)
  keys_smem[...] = keys
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(keys_smem, keys_ref.at[head, key_rows])
  plgpu.wait_smem_to_gmem(0)


def _accumulate(out, sums, acc_gmem, sums_gmem, out_smem, sums_smem, barrier, with_tma: bool):
  """acc_gmem += out and sums_gmem += sums (float32 tiles of one query block)."""
  # The previous step's reduce-adds must have read the staging buffers.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if with_tma:
    out_smem[...] = out
    sums_smem[...] = sums
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, acc_gmem, reduction_op="add")
    plgpu.copy_smem_to_gmem(sums_smem, sums_gmem, reduction_op="add")
    return
  # One program at a time (interpret mode): read, add, write back.
  plgpu.copy_gmem_to_smem(acc_gmem, out_smem, barrier)
  plgpu.copy_gmem_to_smem(sums_gmem, sums_smem, barrier)
  plgpu.barrier_wait(barrier)
  out_smem[...] = out_smem[...] + out
  sums_smem[...] = sums_smem[...] + sums
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, acc_gmem)
  plgpu.copy_smem_to_gmem(sums_smem, sums_gmem)


def forward(q_u, k_u, v_u, q_c, k_c, v_c, in_block_t, shift, *, scale: float, window: int | None,
            config: CastleMosaicConfig, interpret):
  """The Mosaic GPU forward kernel on padded [BH, L, d] arrays.

  Args:
    q_u, k_u, q_c, k_c, v_c: [BH, L, d] in the inputs' dtype (bf16 or f16); L a
      multiple of config.block_q and config.block_k, d in SUPPORTED_HEAD_DIMS.
    v_u: [BH, L, d], the lookahead values (any float dtype; enter as float16).
    in_block_t: [BH, L, block_q] float16; rows of query block i hold R_ii^T
      (R_ii = Q^C_i V^U_i^T * scale under the causal mask).
    shift: float32 [BH, L], the per-row softmax shift m_t.
    scale: the score scale.
    window: None or the CASTLE-SWL window.
    interpret: None, or `plgpu.InterpretGPUParams` to run in GPU interpret mode.

  Returns:
    acc: float32 [BH, L, d], sum_s exp(A[t, s] - m_t) v^C_s; sums: float32 [BH, L],
    sum_s exp(A[t, s] - m_t); keys: float32 [BH, L, d], D after the last query block
    (the lookahead keys u_s^L).
  """
  heads, length, head_dim = q_c.shape
  block_q, block_k = config.block_q, config.block_k
  dtype = q_c.dtype
  kernel = functools.partial(
      _forward_kernel, scale=scale, window=window, block_q=block_q, block_k=block_k,
      num_query_blocks=length // block_q, head_dim=head_dim, interpreted=interpret is not None)
  key_tile = lambda dt: _operand_smem((block_k, head_dim), dt)
  query_tile = lambda dt: _operand_smem((block_q, head_dim), dt)
  scratch = [
      (key_tile(dtype),) * 3,
      (query_tile(dtype), query_tile(LOOKAHEAD_DTYPE), query_tile(dtype), query_tile(LOOKAHEAD_DTYPE)),
      _operand_smem((block_q, block_q), LOOKAHEAD_DTYPE),
      plgpu.SMEM((block_q,), jnp.float32),
      _operand_smem((block_k, block_q), dtype),
      plgpu.SMEM((block_q, head_dim), jnp.float32),
      plgpu.SMEM((block_q,), jnp.float32),
      plgpu.SMEM((block_k, head_dim), jnp.float32),
      _operand_smem((block_k, block_q), LOOKAHEAD_DTYPE) if interpret is not None else None,
      _operand_smem((block_k, head_dim), LOOKAHEAD_DTYPE) if interpret is not None else None,
      # A barrier completes when every copy that signals it has arrived.
      plgpu.Barrier(num_arrivals=len(_KEY_TILES)),
      plgpu.Barrier(num_arrivals=len(_QUERY_TILES)),
      plgpu.Barrier(num_arrivals=2),
  ]
  acc = jax.new_ref(jnp.zeros((heads, length, head_dim), jnp.float32))
  sums = jax.new_ref(jnp.zeros((heads, length), jnp.float32))
  keys = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((heads, length, head_dim), jnp.float32),
      scratch_types=scratch,
      grid=(length // block_k, heads),
      grid_names=("key_block", "head"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(q_u, k_c, v_c, q_c, q_c.astype(LOOKAHEAD_DTYPE), k_u, v_u.astype(LOOKAHEAD_DTYPE), in_block_t, shift,
    acc, sums)
  return acc[...], sums[...], keys
