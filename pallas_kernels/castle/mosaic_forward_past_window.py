"""CASTLE-SWL's (query, key) pairs past the lookahead window, query-block major (Mosaic GPU).

Under a window W, key s's lookahead key stops changing once the queries pass s + W:
from there on u_s^t = u_s^L, the final D that the key-major sweep returns. For those
pairs CASTLE is flash attention with one more score product,

  A[t, s] = q^C_t . k^C_s * scale - SiLU(q^C_t . u_s^L * scale),

so this kernel sweeps them as flash attention does: one program per (2 * block_q
queries, batch * head), each of two consumer warpgroups owning one query block, with
its output tile and row sums in registers over the whole sweep and one reduce-add at
the end. The key-major sweep (`mosaic_forward`, its steps `key_major_sweep_end`) does
the pairs inside the window; at 16K tokens and W = 512 these are ~5% of the pairs, and
the key-major sweep reduce-adds a [block_q, d] float32 tile per step, which is what
this kernel avoids for the rest. Both kernels add into the same float32 accumulators
with the same fixed per-row softmax shift, so the caller's normalization is unchanged.

Per step (key block b of block_k = 128 keys, one key program, in the query-row frame
[block_q queries, block_k keys]):

  S^C = Q^C_i K^C_b^T,  S^U = Q^C_i (D_b * 2^-8)^T          (two wgmmas, float16, one wait)
  P   = exp(S^C * scale - SiLU(S^U * scale * 2^8) - shift_i)
  out_i += P V^C_b,  sums_i += row sums of P                 (wgmma, P from registers)

A producer warpgroup streams K^C_b, D_b and V^C_b through a two-stage ring; the two
consumers alternate on the tensor cores (each one's exponentials run under the other's
products), ordered by a two-arrival barrier, as in flash attention 3. With 128-key steps
the ring takes 192 KB at head dim 128, so each consumer's output leaves through its own
Q^C tile once its sweep is done, in two float32 column halves.
"""

from __future__ import annotations

import functools

from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import mosaic_common
from pallas_kernels.castle import mosaic_forward, mosaic_math
from pallas_kernels.castle.config import CastleMosaicConfig
from pallas_kernels.castle.mosaic_forward import KEY_STATE_SCALE, LOOKAHEAD_DTYPE, PAST_WINDOW_QUERY_BLOCKS, PROBS_DTYPE
from pallas_kernels.mosaic_compiler_params import compiler_params

# Both directions: two consumer warpgroups (each one query block, or one key block) and a
# producer warpgroup streaming the other side's tiles through a ring of STAGES slots.
CONSUMERS = PAST_WINDOW_QUERY_BLOCKS
PRODUCER = CONSUMERS  # warpgroup index of the producer
STAGES = 2
_PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232


def past_window_key_programs(query_program, *, window: int, keys_per_program: int, queries_per_program: int):
  """Number of key programs p (a prefix 0 .. n - 1) whose window ends before `query_program`.

  Key program p is past its window for query program q when its last key + W is below
  q's first query: (p + 1) * keys_per_program - 1 + W < q * queries_per_program, which
  is exactly when `mosaic_forward.key_major_sweep_end(p)` <= q's first query block.
  """
  room = jnp.maximum(query_program * queries_per_program - window, 0)
  return lax.div(room, keys_per_program)


def check_length(length: int, block_q: int, keys_per_program: int):
  """The kernels run on whole query and key programs: a shorter tail would go unswept."""
  multiple = max(CONSUMERS * block_q, keys_per_program)
  if length % multiple:
    raise ValueError(
      f"mosaic_forward_past_window: the sequence length {length} must be a multiple of {multiple} "
      "(pad with mosaic.padded_length)"
    )


def num_key_blocks(query_program, *, window, block_q, block_k, keys_per_program):
  """Key blocks that `query_program` sweeps: those of the key programs past its window."""
  key_programs = past_window_key_programs(
    query_program, window=window, keys_per_program=keys_per_program, queries_per_program=CONSUMERS * block_q
  )
  return key_programs * (keys_per_program // block_k)


def stream_tiles(num_steps, groups, block: int, first_block=0):
  """The producer warpgroup: row blocks first_block .. first_block + num_steps - 1 of the
  sources into ring slots.

  groups: (sources, ring buffers, full barriers, free barriers) tuples; the sources are
  one head's [L, ...] refs, each ring buffer [STAGES, block, ...]. A group's copies of a
  step signal its `full` barrier; its slot is refilled once both consumers released it
  through `free`.
  """
  plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

  @pl.loop(0, num_steps)
  def _load(step):
    slot = lax.rem(step, STAGES)
    rows = pl.ds((first_block + step) * block, block)
    for sources, ring, full, free in groups:

      @pl.when(step >= STAGES)
      def _():
        plgpu.barrier_wait(free.at[slot])

      for src, dst in zip(sources, ring):
        plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], full.at[slot])

  mosaic_common.observe_last_releases([free for _, _, _, free in groups], num_steps, STAGES)


def take_turn(turn_barrier):
  """Wait until the partner consumer has had its turn on the tensor cores."""
  plgpu.barrier_arrive(turn_barrier)
  plgpu.barrier_wait(turn_barrier)


def sweep_in_turns(consumer, turn_barrier, num_steps, step, carry):
  """`step` over 0 .. num_steps - 1, the two consumers alternating on the tensor cores:
  consumer 1 starts a turn behind, and consumer 0 takes the last turn."""
  pl.when(consumer == 1)(functools.partial(take_turn, turn_barrier))
  carry = lax.fori_loop(0, num_steps, step, carry)
  pl.when(consumer == 0)(functools.partial(take_turn, turn_barrier))
  return carry


def query_major_program(
  key_sources, key_ring, ring_barriers, consume, *, window: int, block_q: int, block_k: int, keys_per_program: int
):
  """The warpgroups of one query-major program (query rows [CONSUMERS * block_q * p, ...)).

  The producer streams the key blocks past the program's window from `key_sources`
  (K^C, D, V refs [BH, L, d]) into `key_ring` (K^C and D signal key_full, V values_full;
  `ring_barriers` = (key_full, values_full, key_free, values_free)); each consumer runs
  `consume(consumer, head, rows, num_steps)` on its query block `rows`. Programs with no
  such key block do nothing.
  """
  program = lax.axis_index("query_program")
  head = lax.axis_index("head")
  warpgroup = lax.axis_index("wg")
  num_steps = num_key_blocks(
    program, window=window, block_q=block_q, block_k=block_k, keys_per_program=keys_per_program
  )
  key_full, values_full, key_free, values_free = ring_barriers
  k_src, keys_src, v_src = (ref.at[head] for ref in key_sources)

  @pl.when(jnp.logical_and(num_steps > 0, warpgroup == PRODUCER))
  def _producer():
    stream_tiles(
      num_steps,
      [((k_src, keys_src), key_ring[:2], key_full, key_free), ((v_src,), key_ring[2:], values_full, values_free)],
      block_k,
    )

  @pl.when(jnp.logical_and(num_steps > 0, warpgroup < CONSUMERS))
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    rows = pl.ds(program * CONSUMERS * block_q + warpgroup * block_q, block_q)
    consume(warpgroup, head, rows, num_steps)


def _forward_kernel(
  q_c16_ref,
  k_c16_ref,
  keys16_ref,
  v_c_ref,
  shift_ref,
  acc_ref,
  sums_ref,
  query_union,
  key_ring,
  shift_smem,
  probs_staging,
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
  """One program: query rows [2 * block_q * p, 2 * block_q * (p + 1)) of one head, in steps
  of block_k keys (one key program)."""
  k_ring, keys_ring, v_ring = key_ring
  query_tiles, out_staging = query_union
  query_full, key_full, values_full, key_free, values_free, tensor_core_turn, accumulate_barriers = barriers

  def consume(consumer, head, rows, num_steps):
    q_smem = query_tiles.at[consumer]
    plgpu.copy_gmem_to_smem(q_c16_ref.at[head, rows], q_smem, query_full.at[consumer])
    plgpu.copy_gmem_to_smem(shift_ref.at[head, rows], shift_smem.at[consumer], query_full.at[consumer])
    plgpu.barrier_wait(query_full.at[consumer])
    staging = None if probs_staging is None else probs_staging.at[consumer]
    lookahead_unit = scale / KEY_STATE_SCALE

    def step(index, carry):
      out, sums = carry
      slot = lax.rem(index, STAGES)
      plgpu.barrier_wait(key_full.at[slot])

      def score_products(causal_acc, lookahead_acc):
        plgpu.wgmma(causal_acc, q_smem, k_ring.at[slot].T)
        plgpu.wgmma(lookahead_acc, q_smem, keys_ring.at[slot].T)
        take_turn(tensor_core_turn)
        return causal_acc[...], lookahead_acc[...]

      causal, lookahead = pl.run_scoped(
        score_products, plgpu.ACC((block_q, block_k), jnp.float32), plgpu.ACC((block_q, block_k), jnp.float32)
      )
      plgpu.barrier_arrive(key_free.at[slot])
      shift = lax.broadcast_in_dim(shift_smem.at[consumer][...], (block_q, block_k), [0])
      probs32 = jnp.exp(causal * scale - mosaic_math.silu(lookahead * lookahead_unit) - shift)
      sums = sums + jnp.sum(probs32, axis=1)
      probs = mosaic_common.register_operand(probs32.astype(PROBS_DTYPE), staging)
      # The partner's products run while this warpgroup computed the exponentials; the
      # value product waits for its turn.
      plgpu.barrier_arrive(tensor_core_turn)
      plgpu.barrier_wait(values_full.at[slot])
      plgpu.barrier_wait(tensor_core_turn)
      out = mosaic_common.matmul(probs, v_ring.at[slot], (block_q, head_dim), init=out, init_in_place=not interpreted)
      plgpu.barrier_arrive(values_free.at[slot])
      return out, sums

    out = mosaic_common.wgmma_zeros((block_q, head_dim))
    sums = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    out, sums = sweep_in_turns(consumer, tensor_core_turn, num_steps, step, (out, sums))
    # The [block_q, d] float32 output leaves through this consumer's own Q^C tile (free
    # after its last score products) in two column halves, and the row sums through its
    # shift (read for the last time above): with 128-key steps the ring fills the rest of
    # shared memory.
    half = head_dim // 2
    acc = acc_ref.at[head, rows]
    reduce_add = functools.partial(mosaic_common.reduce_add_tiles, with_tma=not interpreted)
    reduce_add(
      [(out[:, :half], acc.at[:, pl.ds(0, half)], out_staging.at[consumer])], accumulate_barriers[0].at[consumer]
    )
    reduce_add(
      [
        (out[:, half:], acc.at[:, pl.ds(half, half)], out_staging.at[consumer]),
        (sums, sums_ref.at[head, rows], shift_smem.at[consumer]),
      ],
      accumulate_barriers[1].at[consumer],
    )
    plgpu.wait_smem_to_gmem(0)

  query_major_program(
    (k_c16_ref, keys16_ref, v_c_ref),
    key_ring,
    (key_full, values_full, key_free, values_free),
    consume,
    window=window,
    block_q=block_q,
    block_k=block_k,
    keys_per_program=keys_per_program,
  )


def _forward_scratch(block_q, block_k, head_dim, interpreted):
  """Shared memory and barriers of `_forward_kernel` (~225 KB at head dim 128)."""
  ring = lambda dtype: mosaic_common.operand_smem((STAGES, block_k, head_dim), dtype)
  return [
    # Per consumer, Q^C (float16), then (aliased) its output staging: half the columns in float32.
    plgpu.RefUnion(
      mosaic_common.operand_smem((CONSUMERS, block_q, head_dim), LOOKAHEAD_DTYPE),
      plgpu.SMEM((CONSUMERS, block_q, head_dim // 2), jnp.float32),
    ),
    (ring(LOOKAHEAD_DTYPE), ring(LOOKAHEAD_DTYPE), ring(PROBS_DTYPE)),  # K^C, D * 2^-8, V^C
    # Last: a small buffer before the 1 KB-aligned ring would cost its padding, and at
    # 128-key steps the kernel is within ~2 KB of the limit.
    plgpu.SMEM((CONSUMERS, block_q), jnp.float32),  # shift, then row-sum staging
    mosaic_common.operand_smem((CONSUMERS, block_q, block_k), PROBS_DTYPE) if interpreted else None,
    (
      plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS),  # query_full: Q^C, shift
      plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # key_full: K^C, D
      plgpu.Barrier(num_arrivals=1, num_barriers=STAGES),  # values_full
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),  # key_free
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),  # values_free
      plgpu.Barrier(num_arrivals=CONSUMERS),  # tensor_core_turn
      # Interpret mode's reduce-adds (one arrival per tile): the first output half,
      # then the second with the row sums.
      (plgpu.Barrier(num_arrivals=1, num_barriers=CONSUMERS), plgpu.Barrier(num_arrivals=2, num_barriers=CONSUMERS)),
    ),
  ]


def accumulate_past_window(
  q_c16,
  k_c16,
  keys,
  v_c,
  shift,
  acc_ref,
  sums_ref,
  *,
  scale: float,
  window: int,
  block_q: int,
  block_k: int,
  keys_per_program: int,
  interpret,
):
  """Adds the past-window pairs' exp(A - shift) V^C and row sums into `acc_ref`, `sums_ref`.

  Args:
    q_c16, k_c16: float16 [BH, L, d] copies of Q^C and K^C (L a multiple of
      2 * block_q and of keys_per_program).
    keys: float32 [BH, L, d], the final D (the key-major sweep's lookahead keys).
    v_c: [BH, L, d] in PROBS_DTYPE.
    shift: float32 [BH, L], the per-row softmax shift (the key-major sweep's).
    acc_ref, sums_ref: float32 refs [BH, L, d] and [BH, L], added into.
    scale, window: the score scale and the CASTLE-SWL window.
    block_q: query rows per consumer (64: one warpgroup's wgmma).
    block_k: keys per step, a divisor of keys_per_program (the forward takes a whole key
      program per step: [64, 128] score tiles, half the barrier rounds per key of 64).
    keys_per_program: the key-major sweep's keys per program, whose
      `key_major_sweep_end` this kernel complements.
    interpret: None, or `plgpu.InterpretGPUParams` (GPU interpret mode).
  """
  launch = query_major_launch(
    _forward_kernel,
    _forward_scratch,
    q_c16.shape,
    scale=scale,
    window=window,
    block_q=block_q,
    block_k=block_k,
    keys_per_program=keys_per_program,
    interpret=interpret,
    # The row sums run over a WGMMA tile's columns, inside each warp.
    warp_local_reductions=True,
  )
  keys16 = (keys * KEY_STATE_SCALE).astype(LOOKAHEAD_DTYPE)
  launch(q_c16, k_c16, keys16, v_c, shift, acc_ref, sums_ref)


def query_major_launch(
  kernel,
  scratch,
  shape,
  *,
  scale: float,
  window: int,
  block_q: int,
  block_k: int,
  keys_per_program: int,
  interpret,
  warp_local_reductions: bool = False,
):
  """`kernel` (a query-major past-window kernel) as a Mosaic GPU call on [BH, L, d] inputs:
  one program per (CONSUMERS * block_q queries, head), CONSUMERS + 1 warpgroups, the
  shared memory of `scratch(block_q, block_k, head_dim, interpreted)`
  (`warp_local_reductions`: see `mosaic_compiler_params.compiler_params`)."""
  heads, length, head_dim = shape
  check_length(length, block_q, keys_per_program)
  interpreted = interpret is not None
  return plgpu.kernel(
    functools.partial(
      kernel,
      scale=scale,
      window=window,
      block_q=block_q,
      block_k=block_k,
      keys_per_program=keys_per_program,
      head_dim=head_dim,
      interpreted=interpreted,
    ),
    out_type=(),
    scratch_types=scratch(block_q, block_k, head_dim, interpreted),
    grid=(length // (CONSUMERS * block_q), heads),
    grid_names=("query_program", "head"),
    num_threads=CONSUMERS + 1,
    thread_name="wg",
    compiler_params=compiler_params(warp_local_reductions=warp_local_reductions),
    interpret=interpret,
  )


def forward(
  q_u, k_u, v_u, q_c, k_c, v_c, in_block_t, shift, *, scale: float, window: int, config: CastleMosaicConfig, interpret
):
  """CASTLE-SWL's forward: `mosaic_forward.forward`'s arguments (and the window) and results.

  The key-major sweep runs first, up to each key program's `key_major_sweep_end`, and
  returns the final D that the query-major kernel needs for the pairs past the window.
  """
  block_q = config.block_q

  def both_sweeps(acc_ref, sums_ref, keys_ref):
    mosaic_forward.forward_into(
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
      scale=scale,
      window=window,
      config=config,
      interpret=interpret,
    )
    accumulate_past_window(
      q_c.astype(LOOKAHEAD_DTYPE),
      k_c.astype(LOOKAHEAD_DTYPE),
      keys_ref[...],
      v_c.astype(PROBS_DTYPE),
      shift,
      acc_ref,
      sums_ref,
      scale=scale,
      window=window,
      block_q=block_q,
      block_k=config.keys_per_program,
      keys_per_program=config.keys_per_program,
      interpret=interpret,
    )

  return mosaic_common.run_on_zeroed_refs(both_sweeps, mosaic_forward.accumulator_types(q_c))
