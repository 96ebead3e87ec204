"""CASTLE forward as a Pallas Mosaic GPU (Hopper: wgmma + TMA) kernel, key-block major.

The math and the schedule are those of the Triton kernels (`pallas_kernels.castle.triton_kernels`,
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

The schedule (`_warp_specialized_kernel`) takes 2 * block_k keys per program. A producer
warpgroup loads the key tiles once and streams the query tiles (Q^C, K^U, shift through a
two-stage ring; R and V^U, read last in a step, single-buffered) with TMA; two consumer
warpgroups each own one key block's D and probabilities and share every query tile. Per
step one consumer (alternating) writes its P^T next to its partner's in shared memory and
runs one output product over both key blocks, then issues the step's single reduce-add.
The score products of a step are issued together and waited on once; W's two products
too. CASTLE-SWL steps past the program's lookahead window skip W, R, V^U and D's step (3
products instead of 6), and the sweep stops at `key_major_sweep_end`: the pairs after it
are `mosaic_forward_past_window`'s.

In GPU interpret mode each of the three warpgroups is a thread running an XLA CPU program;
with more warpgroups than CPU cores XLA's intra-op thread pool can starve one of them (a
hang) unless `--xla_cpu_enable_concurrency_optimized_scheduler=false` is in XLA_FLAGS
(tests/conftest.py sets it).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.castle import mosaic_math
from pallas_kernels.castle.config import CastleMosaicConfig
from pallas_kernels.mosaic_common import (
  matmul,
  observe_last_releases,
  operand_smem,
  reduce_add_tiles,
  register_operand,
  run_on_zeroed_refs,
  wgmma_zeros,
)
from pallas_kernels.mosaic_compiler_params import compiler_params

# D enters a float16 product scaled by this power of two (exact), and the product is
# scaled back.
KEY_STATE_SCALE = 2.0**-8
LOOKAHEAD_DTYPE = jnp.float16
# What each program loads once (its key blocks).
_KEY_TILES = ("q_u", "k_c", "v_c")


def step_masks(key_start, query_start, shape, window: int | None):
  """(causal, lookahead) boolean tiles of one step in the key-row frame: query >= key,
  and query > key (and query <= key + window for CASTLE-SWL).

  For the steps that need them (the diagonal block, the window's edge): position tiles
  held across a sweep cost 32 registers per thread each, which at head dim 128 spilled.
  """
  offsets = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) - plgpu.broadcasted_iota(
    jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA
  )
  query_minus_key = offsets + (query_start - key_start)
  lookahead = query_minus_key > 0
  if window is not None:
    lookahead &= query_minus_key <= window
  return query_minus_key >= 0, lookahead


def window_interior_end(key_start, diagonal_end, lookahead_end, *, window: int, block_q: int):
  """CASTLE-SWL: one past the last query block inside the window of every key from
  `key_start` on, so that its steps need no mask (the lookahead mask s < j <= s + W and
  the causal one are all true there). The sweep's steps from `diagonal_end` (past the
  diagonal blocks) up to this one run unmasked; the window's edge, up to `lookahead_end`,
  stays masked. Never below `diagonal_end` or above `lookahead_end`.

  Block i lies inside the window of key s >= key_start when its last query
  i * block_q + block_q - 1 <= key_start + W.
  """
  last_inside = lax.div(jnp.maximum(key_start + window + 1 - block_q, 0), block_q)
  return jnp.minimum(lookahead_end, jnp.maximum(diagonal_end, last_inside + 1))


def accumulate_rows(out, sums, acc_gmem, sums_gmem, out_smem, sums_smem, barrier, with_tma: bool):
  """acc_gmem += out and sums_gmem += sums (float32 tiles of one query block; `barrier`
  with two arrivals)."""
  reduce_add_tiles([(out, acc_gmem, out_smem), (sums, sums_gmem, sums_smem)], barrier, with_tma=with_tma)


_PRODUCER = 2  # warpgroup index of the producer; consumers are 0 and 1
_CONSUMERS = 2
_STAGES = 2  # query-tile ring depth
_PRODUCER_REGISTERS = 40
_CONSUMER_REGISTERS = 232
# P and V^C enter the output product in bfloat16 for either input dtype: P = exp(A - m_t)
# exceeds float16's range as soon as a score is ~11 above its row's diagonal score.
PROBS_DTYPE = jnp.bfloat16
# Query blocks per program of the query-major kernel for CASTLE-SWL's pairs past the window
# (`mosaic_forward_past_window`, one consumer warpgroup each).
PAST_WINDOW_QUERY_BLOCKS = 2


def _warp_specialized_kernel(
  q_u_ref,
  k_c16_ref,
  v_c_ref,
  q_c16_ref,
  k_u_ref,
  v_u16_ref,
  in_block_t_ref,
  shift_ref,
  acc_ref,
  sums_ref,
  keys_ref,
  key_union,
  query_ring,
  lookahead_smem,
  exchange_union,
  register_staging,
  barriers,
  *,
  scale: float,
  window: int | None,
  block_q: int,
  block_k: int,
  num_query_blocks: int,
  head_dim: int,
  interpreted: bool,
):
  """One program: key rows [2 * block_k * p, 2 * block_k * (p + 1)) of one head.

  Warpgroup `_PRODUCER` loads the program's key tiles once and streams the query tiles;
  consumer c in {0, 1} owns key block c of the program (its D in registers). Step i
  of the sweep (query block i) alternates which consumer multiplies the probabilities
  of both key blocks by V^C (one K = 2 * block_k output product) and issues the step's
  single reduce-add of the [block_q, d] output tile and the row sums.
  """
  program = lax.axis_index("key_block")
  head = lax.axis_index("head")
  warpgroup = lax.axis_index("wg")
  first = lax.div(program * _CONSUMERS * block_k, block_q)
  # W vanishes from lookahead_end on (CASTLE-SWL): both consumers use the program's end,
  # so that they take the same barriers at every step.
  lookahead_end = num_query_blocks
  if window is not None:
    last_key = (program + 1) * _CONSUMERS * block_k - 1
    lookahead_end = jnp.minimum(num_query_blocks, lax.div(last_key + window, block_q) + 1)
  # The sweep's last query block + 1: all of them, or under a window up to where
  # `mosaic_forward_past_window` takes over.
  sweep_end = (
    num_query_blocks
    if window is None
    else key_major_sweep_end(
      program, window=window, block_q=block_q, block_k=block_k, num_query_blocks=num_query_blocks
    )
  )
  key_tiles, _ = key_union
  q_c16_ring, k_u_ring, shift_ring = query_ring
  in_block_smem, v_u16_smem = lookahead_smem
  (
    key_full,
    query_full,
    k_u_full,
    query_free,
    lookahead_full,
    lookahead_free,
    probs_ready,
    sweep_done,
    accumulate_barrier,
  ) = barriers

  @pl.when(warpgroup == _PRODUCER)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    for src, dst in zip((q_u_ref, k_c16_ref, v_c_ref), key_tiles):
      for consumer in range(_CONSUMERS):
        rows = pl.ds(program * _CONSUMERS * block_k + consumer * block_k, block_k)
        plgpu.copy_gmem_to_smem(src.at[head, rows], dst.at[consumer], key_full)

    @pl.loop(first, sweep_end)
    def _load(query_block):
      index = query_block - first
      slot = lax.rem(index, _STAGES)
      rows = pl.ds(query_block * block_q, block_q)

      @pl.when(index >= _STAGES)
      def _():
        plgpu.barrier_wait(query_free.at[slot])

      plgpu.copy_gmem_to_smem(q_c16_ref.at[head, rows], q_c16_ring.at[slot], query_full.at[slot])
      plgpu.copy_gmem_to_smem(shift_ref.at[head, rows], shift_ring.at[slot], query_full.at[slot])

      @pl.when(query_block < lookahead_end)
      def _():
        plgpu.copy_gmem_to_smem(k_u_ref.at[head, rows], k_u_ring.at[slot], k_u_full.at[slot])

        # R and V^U are single-buffered: they are read last in a step.
        @pl.when(index >= 1)
        def _():
          plgpu.barrier_wait(lookahead_free)

        plgpu.copy_gmem_to_smem(in_block_t_ref.at[head, rows], in_block_smem, lookahead_full)
        plgpu.copy_gmem_to_smem(v_u16_ref.at[head, rows], v_u16_smem, lookahead_full)

    observe_last_releases([query_free], sweep_end - first, _STAGES)
    plgpu.barrier_wait(lookahead_free)

  @pl.when(warpgroup < _CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")
    _consume(
      warpgroup,
      program,
      head,
      first,
      lookahead_end,
      sweep_end,
      acc_ref,
      sums_ref,
      keys_ref,
      key_union,
      query_ring,
      lookahead_smem,
      exchange_union,
      register_staging,
      barriers,
      scale=scale,
      window=window,
      block_q=block_q,
      block_k=block_k,
      num_query_blocks=num_query_blocks,
      head_dim=head_dim,
      interpreted=interpreted,
    )


def _consume(
  consumer,
  program,
  head,
  first,
  lookahead_end,
  sweep_end,
  acc_ref,
  sums_ref,
  keys_ref,
  key_union,
  query_ring,
  lookahead_smem,
  exchange_union,
  register_staging,
  barriers,
  *,
  scale,
  window,
  block_q,
  block_k,
  num_query_blocks,
  head_dim,
  interpreted,
):
  """A consumer warpgroup's sweep over query blocks first .. sweep_end - 1."""
  multiply = functools.partial(matmul, init_in_place=not interpreted)
  (q_u_smem, k_c16_smem, v_c_smem), keys_staging = key_union
  q_c16_ring, k_u_ring, shift_ring = query_ring
  in_block_smem, v_u16_smem = lookahead_smem
  (probs_smem, partner_sums_smem), (out_smem, sums_smem) = exchange_union
  weights_staging, keys16_staging = (
    (None, None) if register_staging is None else (register_staging[0].at[consumer], register_staging[1].at[consumer])
  )
  (
    key_full,
    query_full,
    k_u_full,
    query_free,
    lookahead_full,
    lookahead_free,
    probs_ready,
    sweep_done,
    accumulate_barrier,
  ) = barriers
  q_u_keys, k_c16_keys = q_u_smem.at[consumer], k_c16_smem.at[consumer]
  key_start = program * _CONSUMERS * block_k + consumer * block_k
  # look = D Q^C^T * scale + W R^T is accumulated as one product chain in units of
  # scale / KEY_STATE_SCALE (R arrives pre-divided by it, see `forward`).
  lookahead_unit = scale / KEY_STATE_SCALE
  plgpu.barrier_wait(key_full)

  def step(query_block, keys, *, with_lookahead: bool, masked: bool):
    index = query_block - first
    slot = lax.rem(index, _STAGES)
    rows = pl.ds(query_block * block_q, block_q)
    causal_mask, visible = (
      step_masks(key_start, query_block * block_q, (block_k, block_q), window) if masked else (None, None)
    )
    q_c16 = q_c16_ring.at[slot]
    plgpu.barrier_wait(query_full.at[slot])
    shift = lax.broadcast_in_dim(shift_ring.at[slot][...], (block_k, block_q), [1])
    keys16 = register_operand((keys * KEY_STATE_SCALE).astype(LOOKAHEAD_DTYPE), keys16_staging)

    def products(causal_acc, lookahead_acc):
      # Issued together; the first wait below covers both.
      plgpu.wgmma(causal_acc, k_c16_keys, q_c16.T)
      plgpu.wgmma(lookahead_acc, keys16, q_c16.T)
      if not with_lookahead:
        causal, lookahead = causal_acc[...], lookahead_acc[...]
        plgpu.barrier_arrive(query_free.at[slot])
        return causal, lookahead, keys
      plgpu.barrier_wait(k_u_full.at[slot])
      logits = multiply(q_u_keys, k_u_ring.at[slot].T, (block_k, block_q)) * scale  # waits for all three
      plgpu.barrier_arrive(query_free.at[slot])
      weights = mosaic_math.sigmoid(logits)
      if masked:
        weights = jnp.where(visible, weights, 0.0)
      weights16 = register_operand(weights.astype(LOOKAHEAD_DTYPE), weights_staging)
      plgpu.barrier_wait(lookahead_full)
      # W feeds both of its products from registers: the in-block lookahead term and D's step.
      plgpu.wgmma(lookahead_acc, weights16, in_block_smem)
      new_keys = multiply(weights16, v_u16_smem, (block_k, head_dim), init=keys)  # waits for both
      plgpu.barrier_arrive(lookahead_free)
      return causal_acc[...], lookahead_acc[...], new_keys

    causal, lookahead, keys = pl.run_scoped(
      products, plgpu.ACC((block_k, block_q), jnp.float32), plgpu.ACC((block_k, block_q), jnp.float32)
    )
    lookahead = lookahead * lookahead_unit
    scores = causal * scale - mosaic_math.silu(lookahead) - shift
    probs32 = jnp.exp(scores)
    if masked:
      probs32 = jnp.where(causal_mask, probs32, 0.0)
    probs = probs32.astype(PROBS_DTYPE)

    # The row sums reduce across warps, and Mosaic GPU lowers every such reduction through
    # one shared-memory scratch region at the same offset in both consumers. So the two
    # never reduce at once: the hand-over reduces before it signals probs_ready, the
    # multiplying consumer after it waits for that signal.
    @pl.when(lax.rem(index, _CONSUMERS) == consumer)
    def _multiply_values():
      # The partner's half is written, and its previous reduce-add has read the exchange
      # buffer that this half aliases.
      plgpu.barrier_wait(probs_ready.at[consumer])
      sums = jnp.sum(probs32, axis=0)
      probs_smem.at[consumer][...] = probs
      plgpu.commit_smem()

      def values_product(out_acc):
        for block in range(_CONSUMERS):
          plgpu.wgmma(out_acc, probs_smem.at[block].T, v_c_smem.at[block])
        return out_acc[...]

      out = pl.run_scoped(values_product, plgpu.ACC((block_q, head_dim), jnp.float32))
      total_sums = sums + partner_sums_smem[...]
      accumulate_rows(
        out,
        total_sums,
        acc_ref.at[head, rows],
        sums_ref.at[head, rows],
        out_smem,
        sums_smem,
        accumulate_barrier.at[consumer],
        with_tma=not interpreted,
      )

    @pl.when(lax.rem(index, _CONSUMERS) != consumer)
    def _hand_over_probabilities():
      sums = jnp.sum(probs32, axis=0)
      # This consumer's reduce-add of the previous step must have read the exchange buffer.
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      probs_smem.at[consumer][...] = probs
      partner_sums_smem[...] = sums
      plgpu.commit_smem()
      plgpu.barrier_arrive(probs_ready.at[1 - consumer])

    return keys

  keys = wgmma_zeros((block_k, head_dim))
  # Masks: the program's first two query blocks hold both key blocks' diagonals (and
  # queries before consumer 1's keys); under a window so do the steps at its edge (from
  # the first query block past consumer 0's keys' window on), and the steps past the
  # window need none. Every other step is unmasked.
  lookahead_step = functools.partial(step, with_lookahead=True)
  diagonal_end = first + _CONSUMERS
  keys = lax.fori_loop(first, diagonal_end, functools.partial(lookahead_step, masked=True), keys)
  if window is None:
    keys = lax.fori_loop(diagonal_end, num_query_blocks, functools.partial(lookahead_step, masked=False), keys)
  else:
    interior_end = window_interior_end(
      program * _CONSUMERS * block_k, diagonal_end, lookahead_end, window=window, block_q=block_q
    )
    keys = lax.fori_loop(diagonal_end, interior_end, functools.partial(lookahead_step, masked=False), keys)
    keys = lax.fori_loop(interior_end, lookahead_end, functools.partial(lookahead_step, masked=True), keys)
    keys = lax.fori_loop(lookahead_end, sweep_end, functools.partial(step, with_lookahead=False, masked=False), keys)

  # D leaves through a buffer that aliases the key tiles: both consumers must be done with them.
  plgpu.wait_smem_to_gmem(0)
  plgpu.barrier_arrive(sweep_done)
  plgpu.barrier_wait(sweep_done)
  keys_staging.at[consumer][...] = keys
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(keys_staging.at[consumer], keys_ref.at[head, pl.ds(key_start, block_k)])
  plgpu.wait_smem_to_gmem(0)


def _warp_specialized_scratch(block_q, block_k, head_dim, dtype, interpreted):
  """Shared memory and barriers of `_warp_specialized_kernel` (budget in docs/castle_mosaic.md)."""
  key_tile = lambda dt: operand_smem((_CONSUMERS, block_k, head_dim), dt)
  key_union = plgpu.RefUnion(
    (key_tile(dtype), key_tile(LOOKAHEAD_DTYPE), key_tile(PROBS_DTYPE)),
    plgpu.SMEM((_CONSUMERS, block_k, head_dim), jnp.float32),
  )
  query_ring = (
    operand_smem((_STAGES, block_q, head_dim), LOOKAHEAD_DTYPE),
    operand_smem((_STAGES, block_q, head_dim), dtype),
    plgpu.SMEM((_STAGES, block_q), jnp.float32),
  )
  lookahead_smem = (
    operand_smem((block_q, block_q), LOOKAHEAD_DTYPE),
    operand_smem((block_q, head_dim), LOOKAHEAD_DTYPE),
  )
  # The probabilities of both key blocks, then (aliased) the summed output tile.
  exchange_union = plgpu.RefUnion(
    (operand_smem((_CONSUMERS, block_k, block_q), PROBS_DTYPE), plgpu.SMEM((block_q,), jnp.float32)),
    (plgpu.SMEM((block_q, head_dim), jnp.float32), plgpu.SMEM((block_q,), jnp.float32)),
  )
  register_staging = None
  if interpreted:
    register_staging = (
      operand_smem((_CONSUMERS, block_k, block_q), LOOKAHEAD_DTYPE),
      operand_smem((_CONSUMERS, block_k, head_dim), LOOKAHEAD_DTYPE),
    )
  # A barrier that TMA copies signal completes when all of its copies have arrived.
  barriers = (
    plgpu.Barrier(num_arrivals=len(_KEY_TILES) * _CONSUMERS),  # key_full
    plgpu.Barrier(num_arrivals=2, num_barriers=_STAGES),  # query_full: Q^C, shift
    plgpu.Barrier(num_arrivals=1, num_barriers=_STAGES),  # k_u_full
    plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=_STAGES),  # query_free
    plgpu.Barrier(num_arrivals=2),  # lookahead_full: R, V^U
    plgpu.Barrier(num_arrivals=_CONSUMERS),  # lookahead_free
    plgpu.Barrier(num_arrivals=1, num_barriers=_CONSUMERS),  # probs_ready, per receiver
    plgpu.Barrier(num_arrivals=_CONSUMERS),  # sweep_done
    plgpu.Barrier(num_arrivals=2, num_barriers=_CONSUMERS),  # interpret-mode accumulate
  )
  return [key_union, query_ring, lookahead_smem, exchange_union, register_staging, barriers]


def key_major_sweep_end(program, *, window: int, block_q: int, block_k: int, num_query_blocks):
  """CASTLE-SWL: the first query block that the sweep of key `program` leaves to the
  query-major kernel (`mosaic_forward_past_window`).

  The sweep keeps the query blocks up to the program's window end (its last key + W),
  rounded up to a whole query program of that kernel (PAST_WINDOW_QUERY_BLOCKS query
  blocks), so that a query program is all key-major or all query-major for a key program.
  """
  last_key = (program + 1) * _CONSUMERS * block_k - 1
  lookahead_end = lax.div(last_key + window, block_q) + 1
  rounded = lax.div(lookahead_end + PAST_WINDOW_QUERY_BLOCKS - 1, PAST_WINDOW_QUERY_BLOCKS) * PAST_WINDOW_QUERY_BLOCKS
  return jnp.minimum(num_query_blocks, rounded)


def forward(
  q_u,
  k_u,
  v_u,
  q_c,
  k_c,
  v_c,
  in_block_t,
  shift,
  *,
  scale: float,
  config: CastleMosaicConfig,
  interpret,
):
  """CASTLE's Mosaic GPU forward kernel on padded [BH, L, d] arrays (CASTLE-SWL:
  `mosaic_forward_past_window.forward`).

  Args:
    q_u, k_u, q_c, k_c, v_c: [BH, L, d] in the inputs' dtype (bf16 or f16); L a
      multiple of config.keys_per_program, d in SUPPORTED_HEAD_DIMS.
    v_u: [BH, L, d], the lookahead values (any float dtype; enter as float16).
    in_block_t: float32 [BH, L, block_q]; rows of query block i hold R_ii^T
      (R_ii = Q^C_i V^U_i^T * scale under the causal mask).
    shift: float32 [BH, L], the per-row softmax shift m_t.
    scale: the score scale.
    config: the tiles.
    interpret: None, or `plgpu.InterpretGPUParams` to run in GPU interpret mode.

  Returns:
    acc: float32 [BH, L, d], sum_s exp(A[t, s] - m_t) v^C_s; sums: float32 [BH, L],
    sum_s exp(A[t, s] - m_t); keys: float32 [BH, L, d], D after the last query block
    (the lookahead keys u_s^L).
  """
  call = functools.partial(
    forward_into,
    q_u,
    k_u,
    v_u,
    q_c,
    k_c,
    v_c,
    in_block_t,
    shift,
    scale=scale,
    window=None,
    config=config,
    interpret=interpret,
  )
  return run_on_zeroed_refs(lambda *refs: call(*refs), accumulator_types(q_c))


def accumulator_types(q_c):
  """Shapes of the refs that `forward_into` writes: acc, sums and the final D."""
  heads, length, head_dim = q_c.shape
  rows = jax.ShapeDtypeStruct((heads, length, head_dim), jnp.float32)
  return rows, jax.ShapeDtypeStruct((heads, length), jnp.float32), rows


def key_major_launch(kernel, scratch, *, length: int, heads: int, keys_per_program: int, interpret, num_threads: int):
  """`kernel` as a Mosaic GPU call with one program per (keys_per_program keys, head), grid
  axes "key_block" and "head", and `num_threads` warpgroups on axis "wg"; the
  key-block-major kernels of the forward and the backward."""
  return plgpu.kernel(
    kernel,
    out_type=(),
    scratch_types=scratch,
    grid=(length // keys_per_program, heads),
    grid_names=("key_block", "head"),
    num_threads=num_threads,
    thread_name="wg",
    compiler_params=compiler_params(),
    interpret=interpret,
  )


def forward_into(
  q_u,
  k_u,
  v_u,
  q_c,
  k_c,
  v_c,
  in_block_t,
  shift,
  acc_ref,
  sums_ref,
  keys_ref,
  *,
  scale: float,
  window: int | None,
  config: CastleMosaicConfig,
  interpret,
):
  """`forward`'s kernel, reduce-adding into `acc_ref` and `sums_ref` and writing `keys_ref`;
  under a window (CASTLE-SWL) each key program stops at `key_major_sweep_end`, leaving the
  pairs after it to `mosaic_forward_past_window`.
  """
  heads, length, head_dim = q_c.shape
  block_q, block_k = config.block_q, config.block_k
  interpreted = interpret is not None
  kernel = functools.partial(
    _warp_specialized_kernel,
    scale=scale,
    window=window,
    block_q=block_q,
    block_k=block_k,
    num_query_blocks=length // block_q,
    head_dim=head_dim,
    interpreted=interpreted,
  )
  scratch = _warp_specialized_scratch(block_q, block_k, head_dim, q_c.dtype, interpreted)
  # The causal product takes float16 copies of Q^C and K^C (exact for bf16 values within
  # float16's range), so that Q^C is streamed once for both of its products.
  inputs = (
    q_u,
    k_c.astype(LOOKAHEAD_DTYPE),
    v_c.astype(PROBS_DTYPE),
    q_c.astype(LOOKAHEAD_DTYPE),
    k_u,
    v_u.astype(LOOKAHEAD_DTYPE),
    (in_block_t * (KEY_STATE_SCALE / scale)).astype(LOOKAHEAD_DTYPE),
    shift,
  )
  launch = key_major_launch(
    kernel,
    scratch,
    length=length,
    heads=heads,
    keys_per_program=config.keys_per_program,
    interpret=interpret,
    num_threads=_CONSUMERS + 1,
  )
  # acc and sums are reduce-added into; keys (after them) is written.
  launch(*inputs, acc_ref, sums_ref, keys_ref)
