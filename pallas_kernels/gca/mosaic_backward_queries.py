"""GCA backward, query side (dQ, the chunk weights' gradient and the deltas), as a Pallas
Mosaic GPU (Hopper: wgmma + TMA) kernel.

The math is the Triton `triton_kernels.backward_queries`' (its module docstring derives it). Per
64-row query tile and slot j, from the forward's stored log-normalizer lse_j (base-2):

  P_j  = exp2(Q K_j^T * scale * log2(e) - lse_j)   (padded keys: 0)
  dP_j = dO V_j^T                                  (the cotangent of O'_j, before w_j)
  r_j  = rowsum(P_j * dP_j)  (= rowsum(dO * O'_j))
  dQ  += w_j P_j (dP_j - r_j) K_j,   dQ *= scale at the end

The kernel writes dQ and the row dots r_j; XLA forms delta_j = w_j r_j (what
`triton_kernels.backward_memory` takes) and dw_j = sum of r_j over rows and heads, both O(T k)
work. So the kernel needs no cross-warp reduction at all (r_j reduces along a WGMMA tile's
rows, within a warp).

Schedule (`mosaic_tiles`): one program per (batch * head, 64-row query tile), one
warpgroup; Q and dO loaded once, the slot's log-normalizers [k, 64] in one copy, the k
retrieved chunks' K and V gathered by index through the same TMA ring as the forward. Per
slot the two products that only need the tile's inputs, S = Q K_j^T and dP = dO V_j^T,
are issued together and waited on once; dS (registers) enters dQ += dS K_j as the wgmma's
register operand onto the running accumulator.

GPU interpret mode differs in the same two places as the forward (`register_operand`,
`products(init_in_place=False)`).
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.mosaic_common import operand_smem, products, register_operand
from pallas_kernels.gca.mosaic_tiles import (
  CHUNK_TILE,
  DEFAULT_STAGES,
  TILE_ROWS,
  check_padded,
  key_mask,
  launch,
  products_together,
  query_tile_program,
  ring_bytes,
  ring_scratch,
)

LOG2_E = math.log2(math.e)


def _backward_queries_kernel(
  indices_ref,
  weights_ref,
  queries_ref,
  d_out_ref,
  lse_ref,
  keys_ref,
  values_ref,
  d_queries_ref,
  row_dots_ref,
  query_smem,
  d_out_smem,
  ring_buffers,
  lse_smem,
  row_dots_smem,
  d_scores_staging,
  input_barrier,
  *,
  heads: int,
  group: int,
  tiles_per_chunk: int,
  top_k: int,
  chunk_len: int,
  stages: int,
  scale: float,
  interpreted: bool,
):
  """One program: dQ and the row dots of one 64-row query tile of one (batch, head)."""
  program, ring, weights = query_tile_program(
    indices_ref,
    weights_ref,
    keys_ref,
    values_ref,
    ring_buffers,
    heads=heads,
    group=group,
    tiles_per_chunk=tiles_per_chunk,
    top_k=top_k,
    stages=stages,
  )
  head_dim = query_smem.shape[-1]
  dtype = query_smem.dtype

  plgpu.copy_gmem_to_smem(program.query_rows(queries_ref), query_smem, input_barrier)
  plgpu.copy_gmem_to_smem(program.query_rows(d_out_ref), d_out_smem, input_barrier)
  plgpu.copy_gmem_to_smem(program.slot_rows(lse_ref), lse_smem, input_barrier)
  ring.start()
  plgpu.barrier_wait(input_barrier)
  key_valid = key_mask(chunk_len)
  score_unit = scale * LOG2_E
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  d_queries = None
  for slot in range(top_k):
    keys, values = ring.keys(slot), ring.values(slot)

    scores, d_probs = products_together([(query_smem, keys.T), (d_out_smem, values.T)], shape=(TILE_ROWS, CHUNK_TILE))
    lse = plgpu.load(lse_smem.at[slot], layout=row_layout)
    scores = jnp.where(key_valid, scores * score_unit, -jnp.inf)
    probs = jnp.exp2(scores - lax.broadcast_in_dim(lse, scores.shape, [0]))
    row_dot = jnp.sum(probs * d_probs, axis=1)
    row_dots_smem.at[slot][...] = row_dot
    d_scores = (probs * weights[slot]) * (d_probs - lax.broadcast_in_dim(row_dot, d_probs.shape, [0]))
    d_scores = register_operand(d_scores.astype(dtype), d_scores_staging)
    d_queries = products([(d_scores, keys)], (TILE_ROWS, head_dim), init=d_queries, init_in_place=not interpreted)
    ring.release(slot)

  # The query tile is dead after the last score product: it stages dQ.
  query_smem[...] = (d_queries * scale).astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(query_smem, program.query_rows(d_queries_ref))
  plgpu.copy_smem_to_gmem(row_dots_smem, program.slot_rows(row_dots_ref))
  plgpu.wait_smem_to_gmem(0)


def shared_memory_bytes(head_dim: int, top_k: int, dtype, stages: int = DEFAULT_STAGES) -> int:
  """Shared memory of one program's buffers (the lowering adds barriers and alignment)."""
  query_tiles = 2 * TILE_ROWS * head_dim * jnp.dtype(dtype).itemsize
  return query_tiles + ring_bytes(stages, head_dim, dtype) + 2 * top_k * TILE_ROWS * 4


def backward_queries_native(
  queries,
  keys,
  values,
  weights,
  indices,
  lse,
  d_out,
  *,
  chunk_len: int,
  scale: float,
  stages: int = DEFAULT_STAGES,
  interpret=None,
):
  """The kernel on padded arrays, per-slot rows in the kernels' own layout.

  Args:
    queries, keys, values, weights, indices: as `mosaic_forward.forward_native` takes them.
    lse: float32 [batch, query_chunks, heads, k, query_rows], as `forward_native` returns it.
    d_out: like queries, the output's cotangent (zero in padded rows).
    chunk_len, scale, stages, interpret: as `forward_native`.

  Returns:
    d_queries: like queries; row_dots: float32 [batch, query_chunks, heads, k, query_rows],
    r_j = rowsum(P_j * dO V_j^T).
  """
  check_padded(queries, keys, values, chunk_len=chunk_len, stages=stages)
  batch, query_chunks, query_rows, heads, head_dim = queries.shape
  top_k = indices.shape[-1]
  slot_rows = (batch, query_chunks, heads, top_k, query_rows)
  if d_out.shape != queries.shape or lse.shape != slot_rows:
    raise ValueError(
      f"d_out must be shaped like queries {queries.shape} and lse {slot_rows}; got {d_out.shape} and {lse.shape}"
    )
  interpreted = interpret is not None
  dtype = queries.dtype
  query_tile = lambda: operand_smem((TILE_ROWS, head_dim), dtype)
  scratch = [
    query_tile(),  # Q, then dQ's staging
    query_tile(),  # dO
    ring_scratch(stages, head_dim, dtype),
    plgpu.SMEM((top_k, TILE_ROWS), jnp.float32),  # log-normalizers
    plgpu.SMEM((top_k, TILE_ROWS), jnp.float32),  # row dots
    operand_smem((TILE_ROWS, CHUNK_TILE), dtype) if interpreted else None,  # dS (interpret mode only)
    plgpu.Barrier(num_arrivals=3),  # Q, dO, lse
  ]
  kernel = functools.partial(
    _backward_queries_kernel,
    heads=heads,
    group=heads // keys.shape[3],
    tiles_per_chunk=query_rows // TILE_ROWS,
    top_k=top_k,
    chunk_len=chunk_len,
    stages=stages,
    scale=float(scale),
    interpreted=interpreted,
  )
  out_type = (jax.ShapeDtypeStruct(queries.shape, dtype), jax.ShapeDtypeStruct(slot_rows, jnp.float32))
  return launch(
    kernel,
    out_type,
    scratch,
    batch=batch,
    heads=heads,
    query_chunks=query_chunks,
    query_rows=query_rows,
    interpret=interpret,
  )(indices.astype(jnp.int32), weights.astype(jnp.float32), queries, d_out.astype(dtype), lse, keys, values)


def backward_queries(
  queries,
  keys,
  values,
  weights,
  indices,
  lse,
  d_out,
  *,
  chunk_len: int,
  scale: float,
  stages: int = DEFAULT_STAGES,
  interpret=None,
):
  """`triton_kernels.backward_queries`' contract: lse and delta in the Triton layout
  [batch, query_chunks, k, query_rows, heads].

  Returns:
    d_queries: like queries; delta: float32 like lse, w_j r_j (what `triton_kernels.backward_memory`
    takes); d_weights: float32 [batch, query_chunks, k].
  """
  d_queries, row_dots = backward_queries_native(
    queries,
    keys,
    values,
    weights,
    indices,
    lse.transpose(0, 1, 4, 2, 3),
    d_out,
    chunk_len=chunk_len,
    scale=scale,
    stages=stages,
    interpret=interpret,
  )
  weights = weights.astype(jnp.float32)
  delta = (row_dots * weights[:, :, None, :, None]).transpose(0, 1, 3, 4, 2)
  return d_queries, delta, jnp.sum(row_dots, axis=(2, 4))
