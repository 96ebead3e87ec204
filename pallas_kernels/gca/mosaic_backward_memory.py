"""GCA backward, memory side (dK and dV of every memory chunk), as a Pallas Mosaic GPU
(Hopper: wgmma + TMA) kernel.

The math and the reduction are the Triton `triton_kernels.backward_memory`'s: one program per
(batch, kv head, memory chunk) walks the (query chunk, slot) pairs that retrieved its chunk
(`pairs.retrieving_pairs`: sorted by chunk, pairs of weight 0 excluded) and, for each pair, each
query head of its kv head and each 64-row query tile, recomputes the slot's probabilities
from the stored log-normalizer and accumulates, in the transposed frame (keys as rows, so
that dK and dV are wgmma accumulators with the chunk's 64 keys as their rows):

  S^T  = K Q^T * scale * log2(e)   (padded keys: -inf)
  wP^T = w_j exp2(S^T - lse_j)      (lse_j of the query rows, broadcast along the keys)
  dP^T = V dO^T
  dS^T = wP^T (dP^T - r_j)          (r_j = rowsum(P_j * dO V_j^T), the query side's row dots)
  dV  += wP^T dO,   dK += dS^T Q,   dK *= scale at the end

(w_j P (dP - r_j) is the Triton kernel's P (w_j dP - delta_j) with delta_j = w_j r_j, so the
kernel takes the query side's row dots, not the deltas.) Each memory chunk's gradient is
written once by one program: the gather's VJP as a deterministic scatter-add, with neither
atomics nor a buffer of per-pair partials. A chunk no pair retrieved gets zeros.

Schedule: one warpgroup per program, grid (batch * kv_heads, memory_chunks), the chunk
axis launched fastest (the programs in flight share one (batch, kv head)'s queries and
cotangents in L2). K and V are loaded once. The steps (pair, head, query tile) form one
loop of dynamic length (pairs x group x tiles per chunk, the pairs read from `starts`); each
step's Q and dO tiles, log-normalizer row and row dots are gathered by TMA (the query chunk
and slot read as scalars from `order`) through a `stages`-deep ring, so the next steps'
copies fly while this one computes. Per step the two products that need only the step's
inputs, S^T and dP^T, are issued together and waited on once, then dV and dK's products
(wP^T and dS^T as register operands) together onto the running accumulators; the step's
ring buffers are refilled with step + stages once both are done (that step's pair read from
`order` at the top of the step, so the scalar load's latency hides under the products).

GPU interpret mode differs in the same two places as the query-side kernels (register
operands staged through shared memory, accumulators added after the products).
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.mosaic_common import operand_smem, register_operand
from pallas_kernels.gca.mosaic_tiles import (
  CHUNK_TILE,
  DEFAULT_STAGES,
  TILE_ROWS,
  check_padded,
  key_mask,
  launch_grid,
  products_together,
)

LOG2_E = math.log2(math.e)


def _backward_memory_kernel(
  order_ref,
  starts_ref,
  pair_weights_ref,
  queries_ref,
  d_out_ref,
  lse_ref,
  row_dots_ref,
  keys_ref,
  values_ref,
  d_keys_ref,
  d_values_ref,
  key_smem,
  value_smem,
  query_ring,
  d_out_ring,
  lse_ring,
  row_dots_ring,
  operand_staging,
  chunk_barrier,
  step_barriers,
  *,
  kv_heads: int,
  group: int,
  tiles_per_chunk: int,
  top_k: int,
  chunk_len: int,
  stages: int,
  scale: float,
  interpreted: bool,
):
  """One program: dK and dV of one memory chunk of one (batch, kv head)."""
  batch_kv_head = lax.axis_index("batch_kv_head")
  chunk = lax.axis_index("memory_chunk")
  batch, kv_head = lax.div(batch_kv_head, kv_heads), lax.rem(batch_kv_head, kv_heads)
  memory_tile = (batch, chunk, slice(None), kv_head)
  head_dim = key_smem.shape[-1]
  dtype = key_smem.dtype

  plgpu.copy_gmem_to_smem(keys_ref.at[memory_tile], key_smem, chunk_barrier)
  plgpu.copy_gmem_to_smem(values_ref.at[memory_tile], value_smem, chunk_barrier)
  first_pair = starts_ref[batch, chunk]
  steps_per_pair = group * tiles_per_chunk
  num_steps = (starts_ref[batch, chunk + 1] - first_pair) * steps_per_pair

  last_pair = order_ref.shape[1] - 1

  def step_source(step):
    """(query chunk, slot, head, rows) of a step: pair-major, then head, then query tile. A
    step past the end reads the last pair (and is never loaded)."""
    pair = order_ref[batch, jnp.minimum(first_pair + lax.div(step, steps_per_pair), last_pair)]
    within_pair = lax.rem(step, steps_per_pair)
    head = kv_head * group + lax.div(within_pair, tiles_per_chunk)
    rows = pl.ds(lax.rem(within_pair, tiles_per_chunk) * TILE_ROWS, TILE_ROWS)
    return lax.div(pair, top_k), lax.rem(pair, top_k), head, rows

  def load(step, source):
    stage = lax.rem(step, stages)
    query_chunk, slot, head, rows = source
    barrier = step_barriers.at[stage]
    plgpu.copy_gmem_to_smem(queries_ref.at[batch, query_chunk, rows, head], query_ring.at[stage], barrier)
    plgpu.copy_gmem_to_smem(d_out_ref.at[batch, query_chunk, rows, head], d_out_ring.at[stage], barrier)
    plgpu.copy_gmem_to_smem(lse_ref.at[batch, query_chunk, head, slot, rows], lse_ring.at[stage], barrier)
    plgpu.copy_gmem_to_smem(row_dots_ref.at[batch, query_chunk, head, slot, rows], row_dots_ring.at[stage], barrier)

  for step in range(stages):
    step = jnp.int32(step)
    pl.when(step < num_steps)(functools.partial(load, step, step_source(step)))
  plgpu.barrier_wait(chunk_barrier)
  key_valid = key_mask(chunk_len, keys_axis=0)
  score_unit = scale * LOG2_E
  column_layout = plgpu.Layout.WGMMA.reduce(0)
  probs_staging, d_scores_staging = operand_staging

  def step_body(step, gradients):
    d_keys, d_values = gradients
    stage = lax.rem(step, stages)
    # The pair's weight in pair order: one load, not one behind the pair's own.
    weight = pair_weights_ref[batch, first_pair + lax.div(step, steps_per_pair)]
    # The refill's pair is read now: its latency hides under this step's products.
    refill_source = step_source(step + stages)
    plgpu.barrier_wait(step_barriers.at[stage])
    queries, d_out = query_ring.at[stage], d_out_ring.at[stage]
    scores_t, d_probs_t = products_together(
      [(key_smem, queries.T), (value_smem, d_out.T)], shape=(CHUNK_TILE, TILE_ROWS)
    )
    by_row = lambda ring: lax.broadcast_in_dim(
      plgpu.load(ring.at[stage], layout=column_layout), (CHUNK_TILE, TILE_ROWS), [1]
    )
    scores_t = jnp.where(key_valid, scores_t * score_unit, -jnp.inf)
    weighted_probs_t = jnp.exp2(scores_t - by_row(lse_ring)) * weight
    d_scores_t = weighted_probs_t * (d_probs_t - by_row(row_dots_ring))
    weighted_probs_t = register_operand(weighted_probs_t.astype(dtype), probs_staging)
    d_scores_t = register_operand(d_scores_t.astype(dtype), d_scores_staging)
    d_values, d_keys = products_together(
      [(weighted_probs_t, d_out), (d_scores_t, queries)], inits=(d_values, d_keys), in_place=not interpreted
    )
    pl.when(step + stages < num_steps)(functools.partial(load, step + stages, refill_source))
    return d_keys, d_values

  zeros = plgpu.layout_cast(jnp.zeros((CHUNK_TILE, head_dim), jnp.float32), plgpu.Layout.WGMMA)
  d_keys, d_values = lax.fori_loop(0, num_steps, step_body, (zeros, zeros))

  # K and V are dead after the last step: they stage the gradients.
  key_smem[...] = (d_keys * scale).astype(dtype)
  value_smem[...] = d_values.astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(key_smem, d_keys_ref.at[memory_tile])
  plgpu.copy_smem_to_gmem(value_smem, d_values_ref.at[memory_tile])
  plgpu.wait_smem_to_gmem(0)


def shared_memory_bytes(head_dim: int, dtype, stages: int = DEFAULT_STAGES) -> int:
  """Shared memory of one program's buffers (the lowering adds barriers and alignment)."""
  tile = TILE_ROWS * head_dim * jnp.dtype(dtype).itemsize
  return 2 * tile + stages * (2 * tile + 2 * TILE_ROWS * 4)


def backward_memory_native(
  queries,
  keys,
  values,
  weights,
  lse,
  row_dots,
  d_out,
  order,
  starts,
  *,
  chunk_len: int,
  scale: float,
  stages: int = DEFAULT_STAGES,
  interpret=None,
):
  """dK and dV of every memory chunk, summed over every (query chunk, slot) that retrieved it,
  on padded arrays with per-slot rows in the Mosaic kernels' layout.

  Args:
    queries, keys, values, weights: as `mosaic_forward.forward_native` takes them.
    lse: float32 [batch, query_chunks, heads, k, query_rows], as `forward_native` returns it.
    row_dots: float32, like lse, as `mosaic_backward_queries.backward_queries_native` returns them.
    d_out: like queries, the output's cotangent (zero in padded rows).
    order, starts: int32 [batch, query_chunks * k] and [batch, memory_chunks + 1], as
      `pairs.retrieving_pairs` returns them (chunk m's pairs are order[starts[m]:starts[m + 1]]).
    chunk_len, scale, stages, interpret: as `forward_native`.

  Returns:
    d_keys, d_values: like keys and values (zero in padded keys and for chunks no pair retrieved).
  """
  check_padded(queries, keys, values, chunk_len=chunk_len, stages=stages)
  batch, query_chunks, query_rows, heads, head_dim = queries.shape
  memory_chunks, kv_heads = keys.shape[1], keys.shape[3]
  top_k = weights.shape[-1]
  slot_rows = (batch, query_chunks, heads, top_k, query_rows)
  if d_out.shape != queries.shape or lse.shape != slot_rows or row_dots.shape != slot_rows:
    raise ValueError(
      f"d_out must be shaped like queries {queries.shape}, lse and row_dots {slot_rows}; got "
      f"{d_out.shape}, {lse.shape} and {row_dots.shape}"
    )
  if order.shape != (batch, query_chunks * top_k) or starts.shape != (batch, memory_chunks + 1):
    raise ValueError(
      f"order must be [batch, query_chunks * k] = {(batch, query_chunks * top_k)} and starts "
      f"[batch, memory_chunks + 1] = {(batch, memory_chunks + 1)} (pairs.retrieving_pairs); got "
      f"{order.shape} and {starts.shape}"
    )
  interpreted = interpret is not None
  dtype = queries.dtype
  order = order.astype(jnp.int32)
  staging = lambda: operand_smem((CHUNK_TILE, TILE_ROWS), dtype) if interpreted else None
  scratch = [
    operand_smem((CHUNK_TILE, head_dim), dtype),  # K, then dK's staging
    operand_smem((CHUNK_TILE, head_dim), dtype),  # V, then dV's staging
    operand_smem((stages, TILE_ROWS, head_dim), dtype),  # Q ring
    operand_smem((stages, TILE_ROWS, head_dim), dtype),  # dO ring
    plgpu.SMEM((stages, TILE_ROWS), jnp.float32),  # log-normalizer rows
    plgpu.SMEM((stages, TILE_ROWS), jnp.float32),  # row dots
    (staging(), staging()),  # wP^T, dS^T (interpret mode only)
    plgpu.Barrier(num_arrivals=2),  # K, V
    plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # a step's Q, dO, lse, row dots
  ]
  kernel = functools.partial(
    _backward_memory_kernel,
    kv_heads=kv_heads,
    group=heads // kv_heads,
    tiles_per_chunk=query_rows // TILE_ROWS,
    top_k=top_k,
    chunk_len=chunk_len,
    stages=stages,
    scale=float(scale),
    interpreted=interpreted,
  )
  out_type = (jax.ShapeDtypeStruct(keys.shape, dtype), jax.ShapeDtypeStruct(values.shape, dtype))
  # The weights in pair order (an O(T k) gather), so that a step reads its weight directly.
  pair_weights = jnp.take_along_axis(weights.astype(jnp.float32).reshape(batch, -1), order, axis=1)
  call = launch_grid(
    kernel,
    out_type,
    scratch,
    grid=(batch * kv_heads, memory_chunks),
    grid_names=("batch_kv_head", "memory_chunk"),
    interpret=interpret,
  )
  return call(order, starts.astype(jnp.int32), pair_weights, queries, d_out.astype(dtype), lse, row_dots, keys, values)
