"""The states' part of power attention's outputs as a Pallas Mosaic GPU (Hopper: wgmma + TMA) kernel:
`triton_kernels.query_state_attention(..., with_attention=False)`'s contract.

For 64 query rows of one (batch, head) and the state S, z entering their chunk:

  numerator = e^{G} phi(Q) S   [64, d_v],   denominator = e^{G} phi(Q) . z   [64]

summed over the row blocks of phi (64 expanded features c of one tile pair (s, t) and one
a-group: phi_c = w_st x_{s, a0 + c // 16} x_{t, c % 16}). Per row block, the two factors come out
of products of the query tile with 0/1 selections built in registers and stored to shared
memory (they are the products' right operands), phi = G * T stays in registers as the left
operand of numerator += phi S_block (S_block by TMA through a ring), and the normalizer terms
phi * z accumulate elementwise and are summed over the features once at the end.

Schedule: one program per (batch * head, 64-row query tile), one warpgroup, the query tile
launched fastest (the programs in flight share one chunk's state in L2). GPU interpret mode
(CPU) stages the register operand through shared memory (`pallas_kernels.mosaic_common`).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.gca.mosaic_tiles import launch_grid, products_together
from pallas_kernels.mosaic_common import operand_smem, register_operand, wgmma_zeros
from pallas_kernels.mosaic_kernel_cache import share_identical_kernels
from pallas_kernels.power import mosaic_tiles
from pallas_kernels.power.mosaic_tiles import (
  DEFAULT_STAGES,
  TILE,
  check_inputs,
  kv_head,
  row_blocks,
  state_block_ring,
  store_selections,
  store_tiles,
)

__all__ = ["query_state", "unsupported_reason"]

KERNEL = "the Mosaic query-state kernel"

# Why the kernel cannot take given sizes (naming the argument and the fix), or None.
unsupported_reason = functools.partial(mosaic_tiles.unsupported_reason, KERNEL)


def _kernel(
  columns_ref,
  weights_ref,
  q_ref,
  g_ref,
  state_ref,
  normalizer_ref,
  numerator_ref,
  denominator_ref,
  query_smem,
  g_smem,
  state_ring,
  normalizer_ring,
  selections_smem,
  numerator_staging,
  phi_staging,
  input_barrier,
  block_barriers,
  *,
  heads: int,
  group: int,
  tiles_per_chunk: int,
  num_blocks: int,
  stages: int,
  interpreted: bool,
):
  """One program: the states' numerator and denominator of one 64-row query tile of one (batch, head)."""
  batch_head = lax.axis_index("batch_head")
  query_tile = lax.axis_index("query_tile")
  batch_kv_head = kv_head(batch_head, heads=heads, group=group)
  chunk = lax.div(query_tile, tiles_per_chunk)
  rows = pl.ds(query_tile * TILE, TILE)
  dtype = query_smem.dtype

  plgpu.copy_gmem_to_smem(q_ref.at[batch_head, rows], query_smem, input_barrier)
  plgpu.copy_gmem_to_smem(g_ref.at[batch_kv_head, rows], g_smem, input_barrier)
  ring = state_block_ring(
    state_ref,
    normalizer_ref,
    (state_ring, normalizer_ring),
    block_barriers,
    batch_kv_head=batch_kv_head,
    chunk=chunk,
    num_blocks=num_blocks,
    stages=stages,
  )
  ring.start()
  plgpu.barrier_wait(input_barrier)

  def block_body(block, carry):
    numerator, dot_normalizer = carry
    select_group_smem, select_tile_smem = store_selections(
      selections_smem, columns_ref[block, 0], columns_ref[block, 1], dtype=dtype
    )
    group_factor, tile_factor = products_together(
      [(query_smem, select_group_smem), (query_smem, select_tile_smem)], shape=(TILE, TILE)
    )
    phi = group_factor * tile_factor * weights_ref[block]
    stage = ring.wait(block)
    z = plgpu.load(normalizer_ring.at[stage], layout=plgpu.Layout.WGMMA.reduce(0))
    dot_normalizer = dot_normalizer + phi * lax.broadcast_in_dim(z, phi.shape, [1])
    phi = register_operand(phi.astype(dtype), phi_staging)
    (numerator,) = products_together([(phi, state_ring.at[stage])], inits=(numerator,), in_place=not interpreted)
    ring.refill(block)
    return numerator, dot_normalizer

  value_dim = state_ring.shape[-1]
  init = (wgmma_zeros((TILE, value_dim)), wgmma_zeros((TILE, TILE)))
  numerator, dot_normalizer = lax.fori_loop(0, num_blocks, block_body, init)
  discount = jnp.exp(plgpu.load(g_smem, layout=plgpu.Layout.WGMMA.reduce(1)))
  store_tiles(
    [
      (
        numerator * lax.broadcast_in_dim(discount, numerator.shape, [0]),
        numerator_staging,
        numerator_ref.at[batch_head, rows],
      ),
      (jnp.sum(dot_normalizer, axis=1) * discount, g_smem, denominator_ref.at[batch_head, rows]),
    ]
  )


def query_state(
  q, g, state, normalizer, *, heads: int, kv_heads: int, chunk: int, stages: int = DEFAULT_STAGES, interpret=False
):
  """The states' numerators and denominators of every query row.

  Args:
    q: [B * heads, T, d] (scaled), bf16 or f16, T a multiple of `chunk`.
    g: [B * kv_heads, T] float32 cumulative log-gates within each chunk.
    state: [B * kv_heads, n, D, d_v] in q's dtype, the state entering each chunk (tspow layout,
      16-feature tiles); normalizer: [B * kv_heads, n, D] float32.
    chunk: the chunk length, a multiple of 64.
    stages: depth of the ring of state blocks.
    interpret: run in Pallas GPU interpret mode (CPU; slow, for tests).

  Returns:
    e^{G_i} phi(q_i) S [B * heads, T, d_v] and e^{G_i} phi(q_i) . z [B * heads, T], float32.

  Raises:
    ValueError: sizes or a dtype the kernel does not take (naming the argument).
  """
  check_inputs(KERNEL, q, value_dim=state.shape[-1], chunk=chunk, stages=stages, state=state)
  share_identical_kernels()
  return _query_state(
    q,
    g.astype(jnp.float32),
    state,
    normalizer.astype(jnp.float32),
    heads=heads,
    kv_heads=kv_heads,
    chunk=chunk,
    stages=stages,
    interpret=interpret,
  )


# Jitted, so that a model's layers, which call it with equal shapes, share one traced program
# (`pallas_kernels.castle.mosaic` says why).
@functools.partial(jax.jit, static_argnames=("heads", "kv_heads", "chunk", "stages", "interpret"))
def _query_state(q, g, state, normalizer, *, heads, kv_heads, chunk, stages, interpret):
  bhq, length, head_dim = q.shape
  value_dim = state.shape[-1]
  dtype = q.dtype
  columns, weights = row_blocks(head_dim)
  call = launch_grid(
    functools.partial(
      _kernel,
      heads=heads,
      group=heads // kv_heads,
      tiles_per_chunk=chunk // TILE,
      num_blocks=columns.shape[0],
      stages=stages,
      interpreted=interpret,
    ),
    (jax.ShapeDtypeStruct((bhq, length, value_dim), jnp.float32), jax.ShapeDtypeStruct((bhq, length), jnp.float32)),
    [
      operand_smem((TILE, head_dim), dtype),  # the query tile
      plgpu.SMEM((TILE,), jnp.float32),  # its log-gates, then the denominators' staging
      operand_smem((stages, TILE, value_dim), dtype),  # state blocks
      plgpu.SMEM((stages, TILE), jnp.float32),  # normalizer blocks
      (operand_smem((head_dim, TILE), dtype), operand_smem((head_dim, TILE), dtype)),  # E_group, E_tile
      operand_smem((TILE, value_dim), jnp.float32),  # the numerators' staging
      operand_smem((TILE, TILE), dtype) if interpret else None,  # phi (interpret mode only)
      plgpu.Barrier(num_arrivals=2),
      plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ],
    grid=(bhq, length // TILE),
    grid_names=("batch_head", "query_tile"),
    interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return call(columns, weights, q, g, state, normalizer)
