"""GCA through the Mosaic GPU kernels (Hopper), differentiable with a custom VJP.

Forward: `mosaic_forward` (out and the per-slot log-normalizers in the Mosaic kernels'
layout). Backward: `mosaic_backward_queries` for dQ and the row dots r_j, XLA for
dw = sum of r_j (an O(T k) sum), and `mosaic_backward_memory` for dK and dV (from the same
log-normalizers and row dots, over the (query chunk, slot) pairs sorted by the chunk they
retrieved, `pairs.retrieving_pairs`); no layout transposes between the kernels. Padding is
`mosaic_tiles.pad_inputs`' (query chunks to multiples of 64 rows, memory chunks to 64
keys): exact, as in the Triton path (padded query rows have zero queries and zero
cotangents, so they add nothing to dK and dV; padded keys are masked out of every
softmax_1).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import device_facts
from pallas_kernels.gca import mosaic_backward_memory, mosaic_backward_queries, mosaic_forward, mosaic_tiles
from pallas_kernels.gca.config import GcaMosaicConfig
from pallas_kernels.gca.mosaic_backward_memory import backward_memory_native
from pallas_kernels.gca.mosaic_backward_queries import backward_queries_native
from pallas_kernels.gca.mosaic_forward import forward_native
from pallas_kernels.gca.mosaic_tiles import DEFAULT_STAGES, pad_inputs
from pallas_kernels.gca.pairs import retrieving_pairs
from pallas_kernels.mosaic_kernel_cache import share_identical_kernels
from pallas_kernels.residuals import keep_for_backward


# Shared memory one Mosaic program may ask for: an H100 block's 227 KiB, less what the
# lowering adds to the modules' estimates (barriers, alignment, a reduction scratch).
MOSAIC_SHARED_MEMORY = 227 * 1024 - 4096


def shared_memory_bytes(*, head_dim: int, top_k: int, dtype, stages: int) -> int:
  """The largest of the three Mosaic kernels' shared-memory estimates."""
  return max(
    mosaic_forward.shared_memory_bytes(head_dim, top_k, dtype, stages),
    mosaic_backward_queries.shared_memory_bytes(head_dim, top_k, dtype, stages),
    mosaic_backward_memory.shared_memory_bytes(head_dim, dtype, stages),
  )


def unsupported_reason(
  config: GcaMosaicConfig | None,
  *,
  dtype,
  head_dim: int,
  chunk_len: int,
  query_len: int,
  heads: int,
  kv_heads: int,
  top_k: int,
  interpret: bool,
) -> str | None:
  """None when the Mosaic kernels can run these inputs here (on a Hopper GPU, or anywhere in
  interpret mode), else why not and the fix. `query_len`: rows per query chunk."""
  stages = (config or GcaMosaicConfig()).stages
  query_rows = -(-query_len // mosaic_tiles.TILE_ROWS) * mosaic_tiles.TILE_ROWS
  reason = mosaic_tiles.unsupported_reason(
    head_dim=head_dim,
    chunk_len=chunk_len,
    query_rows=query_rows,
    heads=heads,
    kv_heads=kv_heads,
    dtype=dtype,
    stages=stages,
  )
  if reason:
    return reason
  needed = shared_memory_bytes(head_dim=head_dim, top_k=top_k, dtype=dtype, stages=stages)
  if needed > MOSAIC_SHARED_MEMORY:
    return (
      f"GcaMosaicConfig.stages={stages} asks for about {needed // 1024} KiB of shared memory per program at "
      f"head_dim {head_dim}, over the {MOSAIC_SHARED_MEMORY // 1024} KiB an H100 block gives; lower stages"
    )
  if interpret:
    return None
  return device_facts.not_hopper_reason(
    device_facts.compute_capability(), "the GCA Mosaic GPU kernels", "use implementation='triton'"
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _gca(queries, keys, values, weights, indices, chunk_len, scale, stages, interpreted):
  return _gca_fwd(queries, keys, values, weights, indices, chunk_len, scale, stages, interpreted)[0]


def _interpret(interpreted: bool):
  return plgpu.InterpretGPUParams() if interpreted else None


# Jitted, as CASTLE's Mosaic op is, so that layers calling the op with equal shapes share one
# lowered program: lowering Mosaic kernels again per call site costs seconds of host time.
@functools.partial(jax.jit, static_argnames=("chunk_len", "scale", "stages", "interpreted"))
def _forward(queries, keys, values, weights, indices, *, chunk_len, scale, stages, interpreted):
  return forward_native(
    queries,
    keys,
    values,
    weights,
    indices,
    chunk_len=chunk_len,
    scale=scale,
    stages=stages,
    interpret=_interpret(interpreted),
  )


def _gca_fwd(queries, keys, values, weights, indices, chunk_len, scale, stages, interpreted):
  out, lse = keep_for_backward(
    _forward(
      queries,
      keys,
      values,
      weights,
      indices,
      chunk_len=chunk_len,
      scale=scale,
      stages=stages,
      interpreted=interpreted,
    )
  )
  return out, (queries, keys, values, weights, indices, lse)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _gca_bwd(chunk_len, scale, stages, interpreted, residuals, d_out):
  queries, keys, values, weights, indices, lse = residuals
  d_out = d_out.astype(queries.dtype)
  d_queries, row_dots = backward_queries_native(
    queries,
    keys,
    values,
    weights,
    indices,
    lse,
    d_out,
    chunk_len=chunk_len,
    scale=scale,
    stages=stages,
    interpret=_interpret(interpreted),
  )
  d_weights = jnp.sum(row_dots, axis=(2, 4))
  order, starts = retrieving_pairs(indices, weights, keys.shape[1])
  d_keys, d_values = backward_memory_native(
    queries,
    keys,
    values,
    weights,
    lse,
    row_dots,
    d_out,
    order,
    starts,
    chunk_len=chunk_len,
    scale=scale,
    stages=stages,
    interpret=_interpret(interpreted),
  )
  return d_queries, d_keys, d_values, d_weights, None


_gca.defvjp(_gca_fwd, _gca_bwd)


def gca_attention_mosaic(
  q: jax.Array,
  chunk_k: jax.Array,
  chunk_v: jax.Array,
  chunk_weights: jax.Array,
  chunk_indices: jax.Array,
  *,
  scale: float,
  stages: int = DEFAULT_STAGES,
  interpret: bool = False,
) -> jax.Array:
  """GCA through the Mosaic GPU kernels (Hopper), differentiable in q, chunk_k, chunk_v and
  chunk_weights.

  Args:
    q: [batch, seq, heads, head_dim], bf16/f16, head_dim 64 or 128.
    chunk_k, chunk_v: [batch, memory_chunks, chunk_len, kv_heads, head_dim] in q's dtype,
      chunk_len <= 64.
    chunk_weights: float [batch, query_chunks, k]; chunk_indices: int [batch, query_chunks,
      k] (out-of-range indices are clipped).
    scale: the score scale.
    stages: depth of the Mosaic kernels' rings (K/V tiles; Q/dO tiles in the memory-side backward).
    interpret: run every kernel in its interpret mode (CPU; slow, for tests).

  Returns:
    [batch, seq, heads, head_dim] in q's dtype.

  Raises:
    ValueError: sizes or a dtype the kernels do not take (naming the argument).
  """
  padded = pad_inputs(q, chunk_k, chunk_v, chunk_weights, chunk_indices, stages=stages)
  share_identical_kernels()
  out = _gca(*padded.arrays, padded.chunk_len, float(scale), stages, bool(interpret))
  return padded.unpad(out)
