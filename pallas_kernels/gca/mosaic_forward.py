"""GCA forward as a Pallas Mosaic GPU (Hopper: wgmma + TMA) kernel.

The math is the Triton forward's (`pallas_kernels.gca.triton_kernels`, whose docstring derives
it): for one 64-row query tile and each of its k retrieved memory chunks j (one padded
64-key tile each), in base-2 score units s = Q K_j^T * scale * log2(e):

  m_j = max(0, rowmax s)                       (the implicit zero logit enters the max)
  P_j = exp2(s - m_j)  (padded keys: 0),  l_j = exp2(-m_j) + rowsum P_j
  out = sum_j (w_j / l_j) P_j V_j,  lse_j = m_j + log2(l_j)

Schedule: one program per (batch * head, 64-row query tile), one warpgroup. The program
loads its query tile once and streams the k retrieved chunks' K and V tiles through a
`stages`-deep ring of shared-memory buffers with TMA, each tile gathered straight from
the whole memory by its index (`keys.at[b, index, :, kv_head]`, the index read from
global memory as a scalar; no gathered copy). The k slots are unrolled (k is small, 8 in
DRT), and every slot's index and weight is read at the start, so their load latencies
overlap and no TMA issue waits on one. Per slot: S = Q K_j^T (wgmma, shared x shared^T),
softmax_1 in registers, P_j scaled by w_j / l_j and cast to the operand dtype, then
out += P_j V_j (wgmma with P from registers onto the running accumulator); once both
products of a slot are done its ring buffer is refilled with slot j + stages. K and V
have separate barriers, so the score product waits only for K.

Why no producer warpgroup (the FA3 / CASTLE-Mosaic style): a program does only k = 8 slot
steps and no two query tiles share retrieved chunks, so a producer would sit idle and give
no reuse. The single-warpgroup program is small (at head dim 64, 2 stages: 44 KiB of
shared memory as the lowering allocates, ~100-130 registers per thread), so several
programs share an SM and one program's softmax runs under another's products; that is what
hides the latency. The grid's last axis (fastest in launch order) is the query tile, so
the programs in flight at once share one (batch, head): its whole memory (17 MiB at 64K
tokens: 1040 chunks x 64 keys x 64 x bf16 for K and V) stays in L2 while it is read by
many query tiles. Row maxima and sums reduce along a WGMMA tile's rows, within a warp: no
cross-warp reduction, so the shared-scratch race of the CASTLE warp-specialized kernel
(docs/castle_mosaic.md) cannot arise here.

Outputs: out in the queries' layout, and the per-slot log-normalizers. The kernel writes
them as [batch, query_chunks, heads, k, padded_query_len] (each program's [k, 64] block
contiguous, one TMA store); `forward` transposes them to the Triton kernels' layout
[batch, query_chunks, k, padded_query_len, heads], so that `triton_kernels.backward_queries` and
`triton_kernels.backward_memory` can consume them unchanged.

GPU interpret mode (CPU) runs the same code except in two places, each a helper shared
with the CASTLE Mosaic kernels: the register operand P goes through shared memory
(`register_operand`), and the slot's product is added to the accumulator after the wgmma
instead of accumulated in place (`products(init_in_place=False)`). The H100 lowering test covers the GPU variant.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.gca.mosaic_tiles import (
  CHUNK_TILE,
  DEFAULT_STAGES,
  SUPPORTED_DTYPES,
  SUPPORTED_HEAD_DIMS,
  TILE_ROWS,
  check_padded,
  key_mask,
  launch,
  pad_inputs,
  query_tile_program,
  ring_bytes,
  ring_scratch,
  unsupported_reason,
)
from pallas_kernels.mosaic_common import operand_smem, products, register_operand
from pallas_kernels.mosaic_kernel_cache import share_identical_kernels

__all__ = [
  "CHUNK_TILE",
  "SUPPORTED_DTYPES",
  "SUPPORTED_HEAD_DIMS",
  "TILE_ROWS",
  "forward",
  "forward_native",
  "gca_forward_mosaic",
  "shared_memory_bytes",
  "unsupported_reason",
]

LOG2_E = math.log2(math.e)


def _forward_kernel(
  indices_ref,
  weights_ref,
  queries_ref,
  keys_ref,
  values_ref,
  out_ref,
  lse_ref,
  query_smem,
  ring_buffers,
  lse_smem,
  probs_staging,
  query_barrier,
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
  """One program: one 64-row query tile of one (batch, head), all k slots."""
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

  plgpu.copy_gmem_to_smem(program.query_rows(queries_ref), query_smem, query_barrier)
  ring.start()
  plgpu.barrier_wait(query_barrier)
  key_valid = key_mask(chunk_len)

  def weighted_probabilities(slot: int, scores):
    """softmax_1 of the slot's raw scores, times w_j (the P V product's operand); stores lse_j."""
    scores = jnp.where(key_valid, scores * (scale * LOG2_E), -jnp.inf)
    top = jnp.maximum(scores.max(axis=1), 0.0)
    probs = jnp.exp2(scores - lax.broadcast_in_dim(top, scores.shape, [0]))
    total = jnp.exp2(-top) + probs.sum(axis=1)
    lse_smem.at[slot][...] = top + jnp.log(total) * LOG2_E
    # w_j / l_j folded into P before the product, so that it accumulates in place.
    row_weight = weights[slot] / total
    probs = probs * lax.broadcast_in_dim(row_weight, probs.shape, [0])
    return register_operand(probs.astype(dtype), probs_staging)

  out = None
  for slot in range(top_k):
    scores = products([(query_smem, ring.keys(slot).T)], (TILE_ROWS, CHUNK_TILE))
    probs = weighted_probabilities(slot, scores)
    out = products([(probs, ring.values(slot))], (TILE_ROWS, head_dim), init=out, init_in_place=not interpreted)
    ring.release(slot)

  # The query tile is dead after the last score product: it stages the output.
  query_smem[...] = out.astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(query_smem, program.query_rows(out_ref))
  plgpu.copy_smem_to_gmem(lse_smem, program.slot_rows(lse_ref))
  plgpu.wait_smem_to_gmem(0)


def shared_memory_bytes(head_dim: int, top_k: int, dtype, stages: int = DEFAULT_STAGES) -> int:
  """Shared memory of one program's buffers (the lowering adds barriers and alignment)."""
  query_tile = TILE_ROWS * head_dim * jnp.dtype(dtype).itemsize
  return query_tile + ring_bytes(stages, head_dim, dtype) + top_k * TILE_ROWS * 4


def forward_native(
  queries,
  keys,
  values,
  weights,
  indices,
  *,
  chunk_len: int,
  scale: float,
  stages: int = DEFAULT_STAGES,
  interpret=None,
):
  """The kernel on padded arrays, log-normalizers in the kernel's own layout.

  Args:
    queries: [batch, query_chunks, query_rows, heads, head_dim] (bf16/f16), query_rows a
      multiple of 64 (zero rows pad each query chunk).
    keys, values: [batch, memory_chunks, 64, kv_heads, head_dim] in queries' dtype, each
      chunk's `chunk_len` real keys then zeros.
    weights: float32 [batch, query_chunks, k]; indices: int32 [batch, query_chunks, k],
      in range.
    chunk_len: real keys per memory chunk (the rest are masked out).
    scale: the score scale.
    stages: depth of the K/V ring.
    interpret: None, or `plgpu.InterpretGPUParams` to run in GPU interpret mode.

  Returns:
    out: like queries; lse: float32 [batch, query_chunks, heads, k, query_rows], base-2
    log-normalizers in base-2 score units (as `triton_kernels.forward`'s).
  """
  check_padded(queries, keys, values, chunk_len=chunk_len, stages=stages)
  batch, query_chunks, query_rows, heads, head_dim = queries.shape
  kv_heads = keys.shape[3]
  top_k = indices.shape[-1]
  interpreted = interpret is not None
  dtype = queries.dtype
  scratch = [
    operand_smem((TILE_ROWS, head_dim), dtype),  # query tile, then the output's staging
    ring_scratch(stages, head_dim, dtype),
    plgpu.SMEM((top_k, TILE_ROWS), jnp.float32),  # log-normalizers
    operand_smem((TILE_ROWS, CHUNK_TILE), dtype) if interpreted else None,  # P (interpret mode only)
    plgpu.Barrier(num_arrivals=1),
  ]
  kernel = functools.partial(
    _forward_kernel,
    heads=heads,
    group=heads // kv_heads,
    tiles_per_chunk=query_rows // TILE_ROWS,
    top_k=top_k,
    chunk_len=chunk_len,
    stages=stages,
    scale=float(scale),
    interpreted=interpreted,
  )
  out_type = (
    jax.ShapeDtypeStruct(queries.shape, dtype),
    jax.ShapeDtypeStruct((batch, query_chunks, heads, top_k, query_rows), jnp.float32),
  )
  return launch(
    kernel,
    out_type,
    scratch,
    batch=batch,
    heads=heads,
    query_chunks=query_chunks,
    query_rows=query_rows,
    interpret=interpret,
  )(indices.astype(jnp.int32), weights.astype(jnp.float32), queries, keys, values)


def forward(
  queries,
  keys,
  values,
  weights,
  indices,
  *,
  chunk_len: int,
  scale: float,
  stages: int = DEFAULT_STAGES,
  interpret=None,
):
  """`forward_native` with the log-normalizers in `triton_kernels.forward`'s layout
  [batch, query_chunks, k, query_rows, heads] (one XLA transpose)."""
  out, lse = forward_native(
    queries,
    keys,
    values,
    weights,
    indices,
    chunk_len=chunk_len,
    scale=scale,
    stages=stages,
    interpret=interpret,
  )
  return out, lse.transpose(0, 1, 3, 4, 2)


def gca_forward_mosaic(
  q: jax.Array,
  chunk_k: jax.Array,
  chunk_v: jax.Array,
  chunk_weights: jax.Array,
  chunk_indices: jax.Array,
  *,
  scale: float,
  stages: int = DEFAULT_STAGES,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """GCA forward through the Mosaic GPU kernel (Hopper), in the GCA entry point's layout.
  Not differentiable (forward only).

  Args:
    q: [batch, seq, heads, head_dim], bf16/f16, seq = query_chunks * query_len, head_dim
      64 or 128.
    chunk_k, chunk_v: [batch, memory_chunks, chunk_len, kv_heads, head_dim] in q's dtype,
      chunk_len <= 64.
    chunk_weights: float [batch, query_chunks, k]; chunk_indices: int [batch, query_chunks,
      k] (out-of-range indices are clipped).
    scale: the score scale.
    stages: depth of the kernel's K/V ring.
    interpret: run in Pallas GPU interpret mode (CPU; slow, for tests).

  Returns:
    out: [batch, seq, heads, head_dim] in q's dtype; lse: float32 [batch, query_chunks, k,
    query_rows, heads] (query_rows = query_len rounded up to a multiple of 64; the Triton
    kernels' layout and units, identical to theirs when query_len is a multiple of 64).

  Raises:
    ValueError: sizes or a dtype the kernel does not take (naming the argument).
  """
  padded = pad_inputs(q, chunk_k, chunk_v, chunk_weights, chunk_indices, stages=stages)
  share_identical_kernels()
  out, lse = forward(
    *padded.arrays,
    chunk_len=padded.chunk_len,
    scale=scale,
    stages=stages,
    interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return padded.unpad(out), lse
