"""Power attention's per-chunk states (`triton_kernels.update_state`) as a Pallas Mosaic GPU
(Hopper: wgmma + TMA) kernel.

For a row block of phi (64 expanded features c of one tile pair (s, t) and one a-group: phi_c =
w_st x_{s, a0 + c // 16} x_{t, c % 16}) and a chunk, the kernel accumulates

  dS = phi(X)^T W   [64, d_v],   dz = phi(X)^T u   [64]

over the chunk's tokens. Everything runs in the transposed frame, features as rows, so that no
product's operand needs a shared-memory round trip: per 64-token tile of X (in shared memory,
by TMA),

  G^T = E_group^T X^T,  T^T = E_tile^T X^T   [64 features, 64 tokens]  (0/1 selections E^T
                                               in registers, built once per program)
  phi^T = G^T * T^T   (float32, in registers)
  dS += phi^T W       (phi^T as the register operand, W's tile in shared memory)
  dz += rowsum(phi^T * u)

The selections are K = d products (a 16-column slice of a swizzled tile is no wgmma operand),
three products per tile against the Triton kernel's one plus two of K = 16.

Schedule: one program per (batch * head, chunk, row block), one warpgroup, the row block
launched fastest (the programs in flight share one chunk's X and W in L2); the chunk's token
tiles of X, W and u stream through a `stages`-deep ring. GPU interpret mode (CPU) stages the
register operands through shared memory and adds each product after the wgmma
(`pallas_kernels.mosaic_common`); the H100 lowering test covers the GPU variant.
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
  Ring,
  check_inputs,
  row_blocks,
  selections,
  store_tiles,
)

KERNEL = "the Mosaic update-state kernel"

# Why the kernel cannot take given sizes (naming the argument and the fix), or None.
unsupported_reason = functools.partial(mosaic_tiles.unsupported_reason, KERNEL)


def _kernel(
  columns_ref,
  weights_ref,
  x_ref,
  w_ref,
  u_ref,
  state_ref,
  normalizer_ref,
  x_ring,
  w_ring,
  u_ring,
  state_staging,
  normalizer_staging,
  operand_staging,
  step_barriers,
  *,
  tiles: int,
  stages: int,
  interpreted: bool,
):
  """One program: the state rows and normalizer of one row block of phi, one chunk, one (batch, head)."""
  batch_head = lax.axis_index("batch_head")
  chunk = lax.axis_index("chunk")
  block = lax.axis_index("row_block")
  first_col, tile_col = columns_ref[block, 0], columns_ref[block, 1]
  weight = weights_ref[block]
  head_dim = x_ring.shape[-1]
  dtype = x_ring.dtype
  tokens = lambda step: pl.ds((chunk * tiles + step) * TILE, TILE)
  ring = Ring(
    lambda step: (
      x_ref.at[batch_head, tokens(step)],
      w_ref.at[batch_head, tokens(step)],
      u_ref.at[batch_head, tokens(step)],
    ),
    (x_ring, w_ring, u_ring),
    step_barriers,
    num_steps=tiles,
    stages=stages,
  )
  ring.start()
  group_staging, tile_staging, phi_staging = operand_staging
  select_group, select_tile = selections(first_col, tile_col, (TILE, head_dim), features_axis=1, dtype=dtype)
  select_group = register_operand(select_group, group_staging)
  select_tile = register_operand(select_tile, tile_staging)

  def step_body(step, carry):
    state, normalizer = carry
    stage = ring.wait(step)
    x = x_ring.at[stage]
    group, tile = products_together([(select_group, x.T), (select_tile, x.T)], shape=(TILE, TILE))
    phi = group * tile
    u = plgpu.load(u_ring.at[stage], layout=plgpu.Layout.WGMMA.reduce(0))
    normalizer = normalizer + jnp.sum(phi * lax.broadcast_in_dim(u, phi.shape, [1]), axis=1)
    phi = register_operand(phi.astype(dtype), phi_staging)
    (state,) = products_together([(phi, w_ring.at[stage])], inits=(state,), in_place=not interpreted)
    ring.refill(step)
    return state, normalizer

  value_dim = w_ring.shape[-1]
  normalizer = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
  state, normalizer = lax.fori_loop(0, tiles, step_body, (wgmma_zeros((TILE, value_dim)), normalizer))
  # The block's weight (sqrt(2) off the diagonal) is applied once, to the sums.
  rows = pl.ds(block * TILE, TILE)
  store_tiles(
    [
      (state * weight, state_staging, state_ref.at[batch_head, chunk, rows]),
      (normalizer * weight, normalizer_staging, normalizer_ref.at[batch_head, chunk, rows]),
    ]
  )


def update_state(x, w, u, *, chunk: int, stages: int = DEFAULT_STAGES, interpret: bool = False):
  """Per-chunk states of the expanded rows of x: `triton_kernels.update_state`'s contract.

  Args:
    x: [BH, T, d] (keys; queries in the backward), bf16 or f16, T a multiple of `chunk`.
    w: [BH, T, d_v] in x's dtype, rows already weighted.
    u: [BH, T] float32 row weights of the normalizer.
    chunk: the chunk length, a multiple of 64.
    stages: depth of the ring of streamed token tiles.
    interpret: run in Pallas GPU interpret mode (CPU; slow, for tests).

  Returns:
    state [BH, n, D, d_v] = phi(x_c)^T w_c and normalizer [BH, n, D] = phi(x_c)^T u_c per
    chunk c, float32, in the kernels' tspow layout (16-feature tiles).

  Raises:
    ValueError: sizes or a dtype the kernel does not take (naming the argument).
  """
  check_inputs(KERNEL, x, value_dim=w.shape[-1], chunk=chunk, stages=stages, w=w)
  share_identical_kernels()
  return _update_state(x, w, u.astype(jnp.float32), chunk=chunk, stages=stages, interpret=interpret)


# Jitted, so that a model's layers, which call it with equal shapes, share one traced program
# (`pallas_kernels.castle.mosaic` says why).
@functools.partial(jax.jit, static_argnames=("chunk", "stages", "interpret"))
def _update_state(x, w, u, *, chunk, stages, interpret):
  bh, length, head_dim = x.shape
  value_dim = w.shape[-1]
  dtype = x.dtype
  columns, weights = row_blocks(head_dim)
  num_blocks, num_chunks = columns.shape[0], length // chunk
  staging = lambda width: operand_smem((TILE, width), dtype) if interpret else None
  call = launch_grid(
    functools.partial(_kernel, tiles=chunk // TILE, stages=stages, interpreted=interpret),
    (
      jax.ShapeDtypeStruct((bh, num_chunks, num_blocks * TILE, value_dim), jnp.float32),
      jax.ShapeDtypeStruct((bh, num_chunks, num_blocks * TILE), jnp.float32),
    ),
    [
      operand_smem((stages, TILE, head_dim), dtype),  # X tiles
      operand_smem((stages, TILE, value_dim), dtype),  # W tiles
      plgpu.SMEM((stages, TILE), jnp.float32),  # u
      operand_smem((TILE, value_dim), jnp.float32),  # the state rows' staging
      plgpu.SMEM((TILE,), jnp.float32),  # the normalizer's staging
      (staging(head_dim), staging(head_dim), staging(TILE)),  # E_group^T, E_tile^T, phi^T (interpret mode only)
      plgpu.Barrier(num_arrivals=3, num_barriers=stages),
    ],
    grid=(bh, num_chunks, num_blocks),
    grid_names=("batch_head", "chunk", "row_block"),
    interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return call(columns, weights, x, w, u)
