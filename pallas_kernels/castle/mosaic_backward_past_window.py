"""The backward of CASTLE-SWL's (query, key) pairs past the lookahead window (Mosaic GPU).

Past key s's window its lookahead key is final (`mosaic_forward_past_window`), so these pairs'
backward is flash attention's with one more score term: with S^C = Q^C K^C^T,
S^U = Q^C D^T, P = exp(S^C s - SiLU(S^U s) - lse), dP = dO V^C^T, dS = P (dP - delta)
and dSU = -dS SiLU'(S^U s),

  dQ^C += (dS K^C + dSU D) s,   dK^C += dS^T Q^C s,   dV^C += P^T dO,   dD += dSU^T Q^C s.

Two kernels, neither of which walks D back:
- `accumulate_query_grads`, query-block major: dQ^C in registers over the sweep, added
  into the backward's float32 dQ^C once per query block instead of the key-major sweep's
  reduce-add per (key block, query block) pair; two consumer warpgroups alternate on the
  tensor cores and a producer warpgroup streams K^C, D and V^C through a two-stage ring
  (as the forward's query-major kernel).
- `key_grads_into`, key-block major: dK^C, dV^C and dD of one key block in one warpgroup's
  registers (192 per thread at d = 128), fed by a warpgroup that computes the scores and
  stages P^T, dS^T and dSU^T, and a producer streaming Q^C, dO, lse and delta. The
  key-major sweep (`mosaic_backward`) then runs only inside the window, starting its walk
  back from this dD.

Every operand is float16 (bf16 values within float16's range are exact; P <= 1; dO is
scaled by the caller to max |dO| in [0.5, 1)); D enters scaled by 2^-8 as in the forward,
so dSU enters scaled by 2^8. Range: dS_ts = P_ts (dP_ts - delta_t) with delta_t a
P-weighted mean of dP_t, so |dS| <= max_s |dP_ts| / 2 and |dSU| <= 0.55 max_s |dP_ts|;
dSU * 2^8 stays below float16's 65504 while every |dO_t . v^C_s| < ~460 (after that
rescaling: value vectors of norm ~40 aligned with a row of dO). dS below ~1.5e-5 keeps
fewer significant bits than bfloat16 would (float16 subnormals); such terms are below the
rounding of the larger ones in dQ^C.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.castle import mosaic_math
from pallas_kernels.castle.mosaic_forward import KEY_STATE_SCALE, LOOKAHEAD_DTYPE, key_major_launch, key_major_sweep_end
from pallas_kernels.mosaic_common import (
  accumulate_products,
  observe_last_releases,
  operand_smem,
  products,
  reduce_add_tiles,
  register_operand,
  wgmma_zeros,
)
from pallas_kernels.castle.mosaic_forward_past_window import (
  CONSUMER_REGISTERS,
  CONSUMERS,
  STAGES,
  check_length,
  query_major_launch,
  query_major_program,
  stream_tiles,
  sweep_in_turns,
  take_turn,
)


def _phase(kernel: str, name: str):
  """A named region of a kernel's step ("<kernel>: <name>"), the unit of a Mosaic GPU
  profile (`plgpu.CompilerParams(profile_space=..., profile_dir=...)`)."""
  return jax.named_scope(f"{kernel}: {name}")


def _float16_operands(q_c, k_c, keys, v_c, d_out):
  """The kernels' float16 operands: Q^C, K^C, D * 2^-8, V^C and dO."""
  return tuple(x.astype(LOOKAHEAD_DTYPE) for x in (q_c, k_c, keys * KEY_STATE_SCALE, v_c, d_out))


def _score_products(pairs, tile, while_issued=None):
  """S^C, S^U * 2^-8 and dP of one tile: the three (a, b) wgmma operand `pairs` issued
  together and waited on once (`while_issued()` runs in between)."""

  def issue(*accs):
    for acc, (a, b) in zip(accs, pairs):
      plgpu.wgmma(acc, a, b)
    if while_issued is not None:
      while_issued()
    return tuple(acc[...] for acc in accs)

  return pl.run_scoped(issue, *(plgpu.ACC(tile, jnp.float32) for _ in pairs))


def _score_gradients(causal, lookahead, d_probs, lse_smem, delta_smem, *, scale: float, query_axis: int):
  """(P, dS, dSU) of one tile of past-window pairs from its `_score_products` (float32) and
  its query rows' lse and delta (shared-memory refs [block_q], broadcast along `query_axis`
  of the tile)."""
  lookahead = lookahead * (scale / KEY_STATE_SCALE)
  lse = lax.broadcast_in_dim(lse_smem[...], causal.shape, [query_axis])
  delta = lax.broadcast_in_dim(delta_smem[...], causal.shape, [query_axis])
  silu, silu_grad = mosaic_math.silu_and_grad(lookahead)
  probs = jnp.exp(causal * scale - silu - lse)
  d_scores = probs * (d_probs - delta)
  return probs, d_scores, -d_scores * silu_grad


def _query_grad_kernel(
  q_c16_ref,
  k_c16_ref,
  keys16_ref,
  v_c16_ref,
  d_out16_ref,
  lse_ref,
  delta_ref,
  dq_ref,
  query_union,
  lse_smem,
  delta_smem,
  key_ring,
  grad_staging,
  barriers,
  *,
  scale: float,
  window: int,
  block_q: int,
  block_k: int,
  keys_per_program: int,
  head_dim: int,
  interpreted: bool,
):
  """One program: dQ^C of query rows [2 * block_q * p, 2 * block_q * (p + 1)) of one head
  from the key blocks past their window (query-row frame [block_q, block_k]):

    S^C = Q^C K^C^T,  S^U = Q^C (D * 2^-8)^T,  dP = dO V^C^T           (one wait)
    P = exp(S^C s - SiLU(S^U s 2^8) - lse),  dS = P (dP - delta),  dSU = -dS SiLU'(S^U s 2^8)
    dQ^C += (dS K^C + dSU 2^8 (D * 2^-8)) s                              (P, dS from registers)
  """
  k_ring, keys_ring, v_ring = key_ring
  query_tiles, dq_staging = query_union
  query_full, key_full, values_full, key_free, values_free, tensor_core_turn, io = barriers

  def consume(consumer, head, rows, num_steps):
    q_smem, d_out_smem = query_tiles.at[consumer, 0], query_tiles.at[consumer, 1]
    for src, dst in (
      (q_c16_ref, q_smem),
      (d_out16_ref, d_out_smem),
      (lse_ref, lse_smem.at[consumer]),
      (delta_ref, delta_smem.at[consumer]),
    ):
      plgpu.copy_gmem_to_smem(src.at[head, rows], dst, query_full.at[consumer])
    plgpu.barrier_wait(query_full.at[consumer])
    d_scores_staging, d_lookahead_staging = (
      (None, None) if grad_staging is None else (grad_staging[0].at[consumer], grad_staging[1].at[consumer])
    )
    tile = (block_q, block_k)

    def step(index, d_query):
      slot = lax.rem(index, STAGES)
      with _phase("dQ^C", "wait for the key tiles"):
        plgpu.barrier_wait(key_full.at[slot])
        plgpu.barrier_wait(values_full.at[slot])

      with _phase("dQ^C", "score products"):
        scores = _score_products(
          [(q_smem, k_ring.at[slot].T), (q_smem, keys_ring.at[slot].T), (d_out_smem, v_ring.at[slot].T)],
          tile,
          while_issued=functools.partial(take_turn, tensor_core_turn),
        )
        plgpu.barrier_arrive(values_free.at[slot])
      with _phase("dQ^C", "P, dS, dSU"):
        probs, d_scores, d_lookahead = _score_gradients(
          *scores, lse_smem.at[consumer], delta_smem.at[consumer], scale=scale, query_axis=0
        )
        # D enters scaled by 2^-8, so dSU is scaled by 2^8 to match (exact).
        d_lookahead = d_lookahead * (1.0 / KEY_STATE_SCALE)
        d_scores16 = register_operand(d_scores.astype(LOOKAHEAD_DTYPE), d_scores_staging)
        d_lookahead16 = register_operand(d_lookahead.astype(LOOKAHEAD_DTYPE), d_lookahead_staging)
      with _phase("dQ^C", "wait for the turn"):
        take_turn(tensor_core_turn)
      with _phase("dQ^C", "dQ^C products"):
        d_query = products(
          [(d_scores16, k_ring.at[slot]), (d_lookahead16, keys_ring.at[slot])],
          (block_q, head_dim),
          init=d_query,
          init_in_place=not interpreted,
        )
        plgpu.barrier_arrive(key_free.at[slot])
      return d_query

    d_query = wgmma_zeros((block_q, head_dim))
    d_query = sweep_in_turns(consumer, tensor_core_turn, num_steps, step, d_query)
    # The staging buffer aliases this consumer's own query tiles, which its products have read.
    reduce_add_tiles(
      [(d_query * scale, dq_ref.at[head, rows], dq_staging.at[consumer])], io.at[consumer], with_tma=not interpreted
    )
    plgpu.wait_smem_to_gmem(0)

  query_major_program(
    (k_c16_ref, keys16_ref, v_c16_ref),
    key_ring,
    (key_full, values_full, key_free, values_free),
    consume,
    window=window,
    block_q=block_q,
    block_k=block_k,
    keys_per_program=keys_per_program,
  )


def _query_grad_scratch(block_q, block_k, head_dim, interpreted):
  """Shared memory and barriers of `_query_grad_kernel` (~161 KB at head dim 128)."""
  ring = operand_smem((STAGES, block_k, head_dim), LOOKAHEAD_DTYPE)
  staging = lambda: operand_smem((CONSUMERS, block_q, block_k), LOOKAHEAD_DTYPE)
  return [
    # Per consumer, Q^C and dO (float16), then (aliased) its dQ^C staging in float32.
    plgpu.RefUnion(
      operand_smem((CONSUMERS, 2, block_q, head_dim), LOOKAHEAD_DTYPE),
      plgpu.SMEM((CONSUMERS, block_q, head_dim), jnp.float32),
    ),
    plgpu.SMEM((CONSUMERS, block_q), jnp.float32),  # lse
    plgpu.SMEM((CONSUMERS, block_q), jnp.float32),  # delta
    (ring, ring, ring),  # K^C, D * 2^-8, V^C
    (staging(), staging()) if interpreted else None,  # dS, dSU
    (
      plgpu.Barrier(num_arrivals=4, num_barriers=CONSUMERS),  # query_full
      plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # key_full: K^C, D
      plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # values_full
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),  # key_free
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),  # values_free
      plgpu.Barrier(num_arrivals=CONSUMERS),  # tensor_core_turn
      plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS),  # interpret-mode reduce-add
    ),
  ]


def accumulate_query_grads(
  q_c,
  k_c,
  keys,
  v_c,
  d_out,
  lse,
  delta,
  dq_ref,
  *,
  scale: float,
  window: int,
  block_q: int,
  block_k: int,
  keys_per_program: int,
  interpret,
):
  """Adds the past-window pairs' share of dQ^C into `dq_ref` (float32 [BH, L, d]).

  Args:
    q_c, k_c, v_c, d_out: [BH, L, d] (enter as float16; dO scaled to max |dO| in
      [0.5, 1), as the caller of the backward does).
    keys: float32 [BH, L, d], the forward's final D.
    lse, delta: float32 [BH, L].
    Others as `accumulate_past_window`.
  """
  launch = query_major_launch(
    _query_grad_kernel,
    _query_grad_scratch,
    q_c.shape,
    scale=scale,
    window=window,
    block_q=block_q,
    block_k=block_k,
    keys_per_program=keys_per_program,
    interpret=interpret,
  )
  q_c16, k_c16, keys16, v_c16, d_out16 = _float16_operands(q_c, k_c, keys, v_c, d_out)
  launch(q_c16, k_c16, keys16, v_c16, d_out16, lse, delta, dq_ref)


# Warpgroups of the key-side kernel: one key block's scores and probabilities, its
# gradients dK^C, dV^C and dD, and the producer.
_SCORES, _ACCUMULATOR, _KEY_SIDE_PRODUCER = 0, 1, 2


def _key_grad_kernel(
  k_c16_ref,
  keys16_ref,
  v_c16_ref,
  q_c16_ref,
  d_out16_ref,
  lse_ref,
  delta_ref,
  dk_c_ref,
  dv_c_ref,
  d_keys_ref,
  key_tiles,
  query_ring,
  row_ring,
  grad_staging,
  out_staging,
  barriers,
  *,
  scale: float,
  window: int,
  block_q: int,
  block_k: int,
  num_query_blocks: int,
  head_dim: int,
  interpreted: bool,
):
  """One program: key block b (rows [block_k * b, block_k * (b + 1))) of one head, over
  the query blocks past its key program's window, in the key-row frame [block_k, block_q]:

    S^C^T = K^C Q^C^T,  S^U^T = (D * 2^-8) Q^C^T,  dP^T = V^C dO^T      (one wait)
    P^T = exp(S^C^T s - SiLU(S^U^T s 2^8) - lse),  dS^T = P^T (dP^T - delta),
    dSU^T = -dS^T SiLU'(S^U^T s 2^8)                                    (the scores warpgroup)
    dV^C += P^T dO,  dK^C += dS^T Q^C,  dD += dSU^T Q^C                  (the accumulator warpgroup)

  The scores warpgroup holds no state: it stages P^T, dS^T and dSU^T (float16) in a
  two-slot ring, so it computes the next query block's scores while the accumulator
  warpgroup (the three [block_k, d] float32 states: 192 registers per thread at d = 128)
  runs this one's three products; the producer streams Q^C, dO, lse and delta through a
  two-stage ring.
  """
  key_block = lax.axis_index("key_block")
  head = lax.axis_index("head")
  warpgroup = lax.axis_index("wg")
  first = key_major_sweep_end(
    lax.div(key_block, CONSUMERS), window=window, block_q=block_q, block_k=block_k, num_query_blocks=num_query_blocks
  )
  num_steps = num_query_blocks - first
  key_rows = pl.ds(key_block * block_k, block_k)
  k_smem, keys_smem, v_smem = key_tiles
  q_ring, d_out_ring = query_ring
  lse_ring, delta_ring = row_ring
  key_full, query_full, query_free, grads_ready, staging_free = barriers
  tile = (block_k, block_q)

  @pl.when(jnp.logical_and(num_steps > 0, warpgroup == _KEY_SIDE_PRODUCER))
  def _producer():
    stream_tiles(
      num_steps,
      [
        (
          (q_c16_ref.at[head], d_out16_ref.at[head], lse_ref.at[head], delta_ref.at[head]),
          (q_ring, d_out_ring, lse_ring, delta_ring),
          query_full,
          query_free,
        )
      ],
      block_q,
      first_block=first,
    )

  @pl.when(jnp.logical_and(num_steps > 0, warpgroup == _SCORES))
  def _scores():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    for src, dst in ((k_c16_ref, k_smem), (keys16_ref, keys_smem), (v_c16_ref, v_smem)):
      plgpu.copy_gmem_to_smem(src.at[head, key_rows], dst, key_full)
    plgpu.barrier_wait(key_full)

    @pl.loop(0, num_steps)
    def _step(index):
      slot = lax.rem(index, STAGES)
      q_smem, d_out_smem = q_ring.at[slot], d_out_ring.at[slot]
      with _phase("key side", "wait for the query tiles"):
        plgpu.barrier_wait(query_full.at[slot])

      with _phase("key side", "score products"):
        scores = _score_products([(k_smem, q_smem.T), (keys_smem, q_smem.T), (v_smem, d_out_smem.T)], tile)
        plgpu.barrier_arrive(query_free.at[slot])
      with _phase("key side", "P, dS, dSU"):
        probs, d_scores, d_lookahead = _score_gradients(
          *scores, lse_ring.at[slot], delta_ring.at[slot], scale=scale, query_axis=1
        )

      with _phase("key side", "wait for the staging slot"):
        # The accumulator warpgroup has read this slot's tiles of two steps ago.
        @pl.when(index >= STAGES)
        def _():
          plgpu.barrier_wait(staging_free.at[slot])

      with _phase("key side", "stage P, dS, dSU"):
        for staging, value in zip(grad_staging, (probs, d_scores, d_lookahead)):
          staging.at[slot][...] = value.astype(LOOKAHEAD_DTYPE)
        plgpu.commit_smem()
        plgpu.barrier_arrive(grads_ready.at[slot])

    # The accumulator warpgroup's releases of the last steps (num_steps is a positive
    # multiple of STAGES: key_major_sweep_end rounds to whole query programs).
    observe_last_releases([staging_free], num_steps, STAGES)

  @pl.when(jnp.logical_and(num_steps > 0, warpgroup == _ACCUMULATOR))
  def _accumulator():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    probs_staging, d_scores_staging, d_lookahead_staging = grad_staging

    def step(index, states):
      slot = lax.rem(index, STAGES)
      q_smem, d_out_smem = q_ring.at[slot], d_out_ring.at[slot]
      with _phase("key side", "wait for P, dS, dSU"):
        plgpu.barrier_wait(query_full.at[slot])
        plgpu.barrier_wait(grads_ready.at[slot])
      with _phase("key side", "dV^C, dK^C, dD products"):
        states = accumulate_products(
          [
            ((probs_staging.at[slot], d_out_smem),),
            ((d_scores_staging.at[slot], q_smem),),
            ((d_lookahead_staging.at[slot], q_smem),),
          ],
          states,
          init_in_place=not interpreted,
        )
        plgpu.barrier_arrive(staging_free.at[slot])
        plgpu.barrier_arrive(query_free.at[slot])
      return states

    zeros = wgmma_zeros((block_k, head_dim))
    dv_c, dk_c, d_keys = lax.fori_loop(0, num_steps, step, (zeros, zeros, zeros))
    for state, out_ref in ((dk_c * scale, dk_c_ref), (dv_c, dv_c_ref), (d_keys * scale, d_keys_ref)):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      out_staging[...] = state
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_staging, out_ref.at[head, key_rows])
    plgpu.wait_smem_to_gmem(0)


def _key_grad_scratch(block_q, block_k, head_dim):
  """Shared memory and barriers of `_key_grad_kernel` (~193 KB at head dim 128)."""
  ring = lambda rows: operand_smem((STAGES, rows, head_dim), LOOKAHEAD_DTYPE)
  key_tile = lambda: operand_smem((block_k, head_dim), LOOKAHEAD_DTYPE)
  square_ring = lambda: operand_smem((STAGES, block_k, block_q), LOOKAHEAD_DTYPE)
  return [
    (key_tile(), key_tile(), key_tile()),  # K^C, D * 2^-8, V^C
    (ring(block_q), ring(block_q)),  # Q^C, dO
    (plgpu.SMEM((STAGES, block_q), jnp.float32),) * 2,  # lse, delta
    (square_ring(), square_ring(), square_ring()),  # P^T, dS^T, dSU^T
    plgpu.SMEM((block_k, head_dim), jnp.float32),  # result staging
    (
      plgpu.Barrier(num_arrivals=3),  # key_full: K^C, D, V^C
      plgpu.Barrier(num_arrivals=4, num_barriers=STAGES),  # query_full: Q^C, dO, lse, delta
      plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # query_free: both warpgroups
      plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # grads_ready: P^T, dS^T, dSU^T
      plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # staging_free
    ),
  ]


def key_grads_into(
  q_c,
  k_c,
  keys,
  v_c,
  d_out,
  lse,
  delta,
  dk_c_ref,
  dv_c_ref,
  d_keys_ref,
  *,
  scale: float,
  window: int,
  block_q: int,
  block_k: int,
  keys_per_program: int,
  interpret,
):
  """The key side's gradients (dK^C, dV^C, dD) from the pairs past the window, written into
  zero-filled float32 [BH, L, d] refs: key blocks without such pairs are left as they are.

  The key-major sweep (`mosaic_backward`) runs next inside the same `pl.run_state`: it
  starts its walk back from `d_keys_ref` and reduce-adds its own dK^C and dV^C into these
  refs, so no [BH, L, d] sum is left for XLA.

  Args: as `accumulate_query_grads`.
  """
  heads, length, head_dim = q_c.shape
  check_length(length, block_q, keys_per_program)
  if keys_per_program != CONSUMERS * block_k:
    raise ValueError(f"key_grads: keys_per_program must be {CONSUMERS} * block_k, got {keys_per_program}")
  interpreted = interpret is not None
  launch = key_major_launch(
    functools.partial(
      _key_grad_kernel,
      scale=scale,
      window=window,
      block_q=block_q,
      block_k=block_k,
      num_query_blocks=length // block_q,
      head_dim=head_dim,
      interpreted=interpreted,
    ),
    _key_grad_scratch(block_q, block_k, head_dim),
    length=length,
    heads=heads,
    keys_per_program=block_k,
    interpret=interpret,
    num_threads=3,
  )
  q_c16, k_c16, keys16, v_c16, d_out16 = _float16_operands(q_c, k_c, keys, v_c, d_out)
  launch(k_c16, keys16, v_c16, q_c16, d_out16, lse, delta, dk_c_ref, dv_c_ref, d_keys_ref)
