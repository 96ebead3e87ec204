"""GCA forward as a Pallas Mosaic GPU (Hopper: wgmma + TMA) kernel.

The math is the Triton forward's (`pallas_kernels.gca.kernels`, whose docstring derives
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

Why no producer warpgroup (the FA3 / CASTLE-Mosaic style): a program does only k = 8
slot steps and no two query tiles share retrieved chunks, so a producer would sit idle
and give no reuse. The single-warpgroup program is small (at head dim 64, 2 stages:
~42 KiB of shared memory, ~100-130 registers per thread), so several programs share an
SM and one program's softmax runs under another's products; that is what hides the
latency. The grid's last axis (fastest in launch order) is the query tile, so the
programs in flight at once share one (batch, head): its whole memory (16 MiB at 1024
chunks x 64 keys x 64 x bf16 for K and V) stays in L2 while it is read by many query
tiles. Row maxima and sums reduce along a WGMMA tile's rows, within a warp: no
cross-warp reduction, so the shared-scratch race of the CASTLE warp-specialized kernel
(docs/castle_mosaic.md) cannot arise here.

Outputs: out in the queries' layout, and the per-slot log-normalizers. The kernel writes
them as [batch, query_chunks, heads, k, padded_query_len] (each program's [k, 64] block
contiguous, one TMA store); `forward` transposes them to the Triton kernels' layout
[batch, query_chunks, k, padded_query_len, heads], so that `kernels.backward_queries` and
`kernels.backward_memory` can consume them unchanged.

GPU interpret mode (CPU) runs the same code except in two places, each a helper shared
with the CASTLE Mosaic kernels: the register operand P goes through shared memory
(`_register_operand`), and the slot's product is added to the accumulator after the wgmma
instead of accumulated in place (`products(init_in_place=False)`). The H100 lowering test
covers the GPU variant.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

# Shared with the CASTLE Mosaic kernels: TMA/wgmma shared-memory layout, wgmma products, and
# the interpret-mode staging of register operands.
from pallas_kernels.castle.mosaic_forward import _operand_smem, _register_operand, products

LOG2_E = math.log2(math.e)
TILE_ROWS = 64             # query rows per program: one warpgroup's wgmma rows
CHUNK_TILE = 64            # keys per memory-chunk tile (chunks padded to it)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
DEFAULT_STAGES = 2


def unsupported_reason(*, head_dim: int, chunk_len: int, query_rows: int, heads: int, kv_heads: int, dtype,
                       stages: int = DEFAULT_STAGES) -> str | None:
  """Why the Mosaic forward cannot take inputs of these sizes (naming the argument and the
  fix), or None. `query_rows` are the (padded) rows per query chunk the kernel sees."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (f"the GCA Mosaic forward takes q in {[jnp.dtype(d).name for d in SUPPORTED_DTYPES]} (wgmma's 16-bit "
            f"operands), got dtype {jnp.dtype(dtype).name}; cast q, chunk_k and chunk_v or use the Triton kernels "
            "(gca_attention_pallas)")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return (f"the GCA Mosaic forward takes head_dim in {SUPPORTED_HEAD_DIMS} (last axis of q), got {head_dim}; use "
            "the Triton kernels (gca_attention_pallas)")
  if not 1 <= chunk_len <= CHUNK_TILE:
    return (f"the GCA Mosaic forward takes memory chunks of 1..{CHUNK_TILE} keys (chunk_len, axis 2 of chunk_k), "
            f"got {chunk_len}; use the Triton kernels (gca_attention_pallas)")
  if query_rows % TILE_ROWS:
    return (f"the GCA Mosaic forward needs query chunks padded to a multiple of {TILE_ROWS} rows (query_rows), got "
            f"{query_rows}; pad them (gca_forward_mosaic does)")
  if kv_heads < 1 or heads % kv_heads:
    return f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}, axis 3 of chunk_k)"
  if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
    return f"stages must be an int >= 1 (ring depth of K/V tiles), got {stages!r}"
  return None


def _forward_kernel(indices_ref, weights_ref, queries_ref, keys_ref, values_ref, out_ref, lse_ref,
                    query_smem, key_ring, value_ring, lse_smem, probs_staging, query_barrier, key_barriers,
                    value_barriers, *, heads: int, group: int, tiles_per_chunk: int, top_k: int, chunk_len: int,
                    stages: int, scale: float, interpreted: bool):
  """One program: query tile `query_tile` (64 rows of one query chunk) of one (batch, head)."""
  batch_head = lax.axis_index("batch_head")
  query_tile = lax.axis_index("query_tile")
  batch, head = lax.div(batch_head, heads), lax.rem(batch_head, heads)
  kv_head = lax.div(head, group)
  chunk = lax.div(query_tile, tiles_per_chunk)
  rows = pl.ds(lax.rem(query_tile, tiles_per_chunk) * TILE_ROWS, TILE_ROWS)
  head_dim = query_smem.shape[-1]
  dtype = query_smem.dtype

  # Every slot's index and weight up front: their global-memory latencies overlap, and no
  # TMA issue or softmax waits on one.
  indices = [indices_ref[batch, chunk, slot] for slot in range(top_k)]
  weights = [weights_ref[batch, chunk, slot] for slot in range(top_k)]

  def load(slot: int):
    """TMA copies of slot's K and V tiles into ring buffer slot % stages."""
    stage = slot % stages
    source = (batch, indices[slot], slice(None), kv_head)
    plgpu.copy_gmem_to_smem(keys_ref.at[source], key_ring[stage], key_barriers.at[stage])
    plgpu.copy_gmem_to_smem(values_ref.at[source], value_ring[stage], value_barriers.at[stage])

  plgpu.copy_gmem_to_smem(queries_ref.at[batch, chunk, rows, head], query_smem, query_barrier)
  for slot in range(min(stages, top_k)):
    load(slot)
  plgpu.barrier_wait(query_barrier)

  key_valid = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, CHUNK_TILE), 1, layout=plgpu.Layout.WGMMA) < chunk_len
  score_unit = scale * LOG2_E

  # The k slots unrolled (k is small: 8 in DRT): ring stages, log-normalizer rows and
  # refills are static.
  out = None
  for slot in range(top_k):
    stage = slot % stages
    plgpu.barrier_wait(key_barriers.at[stage])
    scores = products([(query_smem, key_ring[stage].T)], (TILE_ROWS, CHUNK_TILE)) * score_unit
    scores = jnp.where(key_valid, scores, -jnp.inf)
    top = jnp.maximum(scores.max(axis=1), 0.0)
    probs = jnp.exp2(scores - lax.broadcast_in_dim(top, scores.shape, [0]))
    total = jnp.exp2(-top) + probs.sum(axis=1)
    lse_smem.at[slot][...] = top + jnp.log(total) * LOG2_E
    # w_j / l_j folded into P before the product, so that it accumulates in place.
    row_weight = weights[slot] / total
    probs = probs * lax.broadcast_in_dim(row_weight, probs.shape, [0])
    probs = _register_operand(probs.astype(dtype), probs_staging)
    plgpu.barrier_wait(value_barriers.at[stage])
    out = products([(probs, value_ring[stage])], (TILE_ROWS, head_dim), init=out,
                   init_in_place=not interpreted)
    # Both products of the slot are done: its ring buffer takes slot + stages.
    if slot + stages < top_k:
      load(slot + stages)

  # The query tile is dead after the last score product: it stages the output.
  query_smem[...] = out.astype(dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(query_smem, out_ref.at[batch, chunk, rows, head])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, chunk, head, :, rows])
  plgpu.wait_smem_to_gmem(0)


def shared_memory_bytes(head_dim: int, top_k: int, dtype, stages: int = DEFAULT_STAGES) -> int:
  """Shared memory of one program's buffers (the lowering adds barriers and alignment)."""
  itemsize = jnp.dtype(dtype).itemsize
  tile = TILE_ROWS * head_dim * itemsize
  return tile + 2 * stages * CHUNK_TILE * head_dim * itemsize + top_k * TILE_ROWS * 4


def forward_native(queries, keys, values, weights, indices, *, chunk_len: int, scale: float,
                   stages: int = DEFAULT_STAGES, interpret=None):
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
    log-normalizers in base-2 score units (as `kernels.forward`'s).
  """
  batch, query_chunks, query_rows, heads, head_dim = queries.shape
  memory_chunks, padded_chunk_len, kv_heads = keys.shape[1:4]
  top_k = indices.shape[-1]
  reason = unsupported_reason(head_dim=head_dim, chunk_len=chunk_len, query_rows=query_rows, heads=heads,
                              kv_heads=kv_heads, dtype=queries.dtype, stages=stages)
  if reason:
    raise ValueError(reason)
  if padded_chunk_len != CHUNK_TILE or keys.shape != values.shape or keys.dtype != queries.dtype:
    raise ValueError(f"keys and values must be [batch, memory_chunks, {CHUNK_TILE}, kv_heads, head_dim] in queries' "
                     f"dtype {queries.dtype}, got {keys.shape} {keys.dtype} and {values.shape} {values.dtype}")
  interpreted = interpret is not None
  dtype = queries.dtype
  tiles_per_chunk = query_rows // TILE_ROWS
  # The ring as separate buffers: the unrolled slots pick theirs statically (a static index
  # into one buffer does not lower inside a preinitialized accumulator's scope).
  ring = lambda: tuple(_operand_smem((CHUNK_TILE, head_dim), dtype) for _ in range(stages))
  scratch = [
      _operand_smem((TILE_ROWS, head_dim), dtype),                      # query tile, then the output's staging
      ring(), ring(),                                                   # K and V ring
      plgpu.SMEM((top_k, TILE_ROWS), jnp.float32),                      # log-normalizers
      _operand_smem((TILE_ROWS, CHUNK_TILE), dtype) if interpreted else None,  # P (interpret mode only)
      plgpu.Barrier(num_arrivals=1),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),
  ]
  kernel = functools.partial(_forward_kernel, heads=heads, group=heads // kv_heads, tiles_per_chunk=tiles_per_chunk,
                             top_k=top_k, chunk_len=chunk_len, stages=stages, scale=float(scale),
                             interpreted=interpreted)
  return plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct(queries.shape, dtype),
                jax.ShapeDtypeStruct((batch, query_chunks, heads, top_k, query_rows), jnp.float32)),
      scratch_types=scratch,
      # The last axis launches fastest: the programs in flight share one (batch, head)'s memory in L2.
      grid=(batch * heads, query_chunks * tiles_per_chunk),
      grid_names=("batch_head", "query_tile"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret,
  )(indices.astype(jnp.int32), weights.astype(jnp.float32), queries, keys, values)


def forward(queries, keys, values, weights, indices, *, chunk_len: int, scale: float,
            stages: int = DEFAULT_STAGES, interpret=None):
  """`forward_native` with the log-normalizers in `kernels.forward`'s layout
  [batch, query_chunks, k, query_rows, heads] (one XLA transpose)."""
  out, lse = forward_native(queries, keys, values, weights, indices, chunk_len=chunk_len, scale=scale, stages=stages,
                            interpret=interpret)
  return out, lse.transpose(0, 1, 3, 4, 2)


def gca_forward_mosaic(q: jax.Array, chunk_k: jax.Array, chunk_v: jax.Array, chunk_weights: jax.Array,
                       chunk_indices: jax.Array, *, scale: float, stages: int = DEFAULT_STAGES,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
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
  batch, seq, heads, head_dim = q.shape
  memory_chunks, chunk_len, kv_heads = chunk_k.shape[1:4]
  query_chunks = chunk_indices.shape[1]
  if chunk_k.dtype != q.dtype or chunk_v.shape != chunk_k.shape or chunk_v.dtype != q.dtype:
    raise ValueError(f"chunk_k and chunk_v must have one shape and q's dtype {q.dtype}; got {chunk_k.shape} "
                     f"{chunk_k.dtype} and {chunk_v.shape} {chunk_v.dtype}")
  if seq % query_chunks:
    raise ValueError(f"q's seq ({seq}) must be query_chunks ({query_chunks}, axis 1 of chunk_indices) times the "
                     "query chunk length")
  query_len = seq // query_chunks
  query_rows = -(-query_len // TILE_ROWS) * TILE_ROWS
  reason = unsupported_reason(head_dim=head_dim, chunk_len=chunk_len, query_rows=query_rows, heads=heads,
                              kv_heads=kv_heads, dtype=q.dtype, stages=stages)
  if reason:
    raise ValueError(reason)
  queries = q.reshape(batch, query_chunks, query_len, heads, head_dim)
  queries = jnp.pad(queries, ((0, 0), (0, 0), (0, query_rows - query_len), (0, 0), (0, 0)))
  key_padding = ((0, 0), (0, 0), (0, CHUNK_TILE - chunk_len), (0, 0), (0, 0))
  keys, values = jnp.pad(chunk_k, key_padding), jnp.pad(chunk_v, key_padding)
  indices = jnp.clip(chunk_indices.astype(jnp.int32), 0, memory_chunks - 1)
  out, lse = forward(queries, keys, values, chunk_weights.astype(jnp.float32), indices, chunk_len=chunk_len,
                     scale=scale, stages=stages, interpret=plgpu.InterpretGPUParams() if interpret else None)
  return out[:, :, :query_len].reshape(batch, seq, heads, head_dim), lse
