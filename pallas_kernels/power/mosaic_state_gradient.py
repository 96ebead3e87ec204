"""Gradients through power attention's state products as a Pallas Mosaic GPU (Hopper: wgmma + TMA)
kernel: `triton_kernels.state_gradient`'s contract.

For 64 rows x_i of one (batch, head) and the state S, z of their chunk, with cotangents c_i
[d_v] and c^z_i, the function f_i = phi(x_i) . (S c_i + z c^z_i) has

  M = (c S^T + c^z z^T) * w   [64, features]  per row block of phi,
  dx = sum over row blocks of (M * T) E_group^T + (M * G) E_tile^T   [64, d],

where G = x E_group and T = x E_tile are the block's two factors (0/1 selections E, so that
phi = G * T) and w its weight; f = x . dx / 2 (f is a homogeneous quadratic in x), and with
`with_product` also phi(x) S. Per row block: M's product (c from shared memory against the state
block, by TMA through a ring, transposed), the two factors (selections built in registers and
stored to shared memory, the products' right operands), the two products into dx (M * T and
M * G as register operands against the transposed selections), and phi S.

Schedule: one program per (batch * head, 64-row tile), one warpgroup, the tile launched fastest.
GPU interpret mode (CPU) stages the register operands through shared memory
(`pallas_kernels.mosaic_common`).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.gca.mosaic_tiles import launch_grid, products_together
from pallas_kernels.mosaic_common import accumulate_products, operand_smem, register_operand, wgmma_zeros
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

__all__ = ["state_gradient", "unsupported_reason"]

KERNEL = "the Mosaic state-gradient kernel"

# Why the kernel cannot take given sizes (naming the argument and the fix), or None.
unsupported_reason = functools.partial(mosaic_tiles.unsupported_reason, KERNEL)


def _kernel(
  columns_ref,
  weights_ref,
  x_ref,
  cotangent_ref,
  cotangent_normalizer_ref,
  state_ref,
  normalizer_ref,
  *refs,
  heads: int,
  group: int,
  tiles_per_chunk: int,
  num_blocks: int,
  stages: int,
  with_product: bool,
  interpreted: bool,
):
  """One program: dx, f and (with_product) phi(x) S of one 64-row tile of one (batch, head)."""
  outputs, scratch = (refs[:3], refs[3:]) if with_product else ((*refs[:2], None), refs[2:])
  dx_ref, phi_dot_ref, product_ref = outputs
  (x_smem, cotangent_smem, vectors_smem, state_ring, normalizer_ring, selections_smem, staging, barriers) = scratch
  dx_staging, product_staging, operand_staging = staging
  input_barrier, block_barriers = barriers
  batch_head = lax.axis_index("batch_head")
  tile = lax.axis_index("row_tile")
  batch_kv_head = kv_head(batch_head, heads=heads, group=group)
  chunk = lax.div(tile, tiles_per_chunk)
  rows = pl.ds(tile * TILE, TILE)
  dtype = x_smem.dtype
  head_dim = x_smem.shape[-1]
  cotangent_normalizer_smem, phi_dot_smem = vectors_smem

  plgpu.copy_gmem_to_smem(x_ref.at[batch_head, rows], x_smem, input_barrier)
  plgpu.copy_gmem_to_smem(cotangent_ref.at[batch_head, rows], cotangent_smem, input_barrier)
  plgpu.copy_gmem_to_smem(cotangent_normalizer_ref.at[batch_head, rows], cotangent_normalizer_smem, input_barrier)
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

  cotangent_normalizer = plgpu.load(cotangent_normalizer_smem, layout=plgpu.Layout.WGMMA.reduce(1))
  by_row = lambda vector: lax.broadcast_in_dim(vector, (TILE, TILE), [0])
  d_tile_staging, d_group_staging, phi_staging = operand_staging

  def block_body(block, carry):
    dx, product = carry
    weight = weights_ref[block]
    select_group_smem, select_tile_smem = store_selections(
      selections_smem, columns_ref[block, 0], columns_ref[block, 1], dtype=dtype
    )
    stage = ring.wait(block)
    state = state_ring.at[stage]
    group_factor, tile_factor, m = products_together(
      [(x_smem, select_group_smem), (x_smem, select_tile_smem), (cotangent_smem, state.T)], shape=(TILE, TILE)
    )
    z = plgpu.load(normalizer_ring.at[stage], layout=plgpu.Layout.WGMMA.reduce(0))
    m = (m + by_row(cotangent_normalizer) * lax.broadcast_in_dim(z, (TILE, TILE), [1])) * weight
    d_tile = register_operand((m * tile_factor).astype(dtype), d_tile_staging)
    d_group = register_operand((m * group_factor).astype(dtype), d_group_staging)
    pair_groups = [[(d_tile, select_group_smem.T), (d_group, select_tile_smem.T)]]
    accumulators = [dx]
    if with_product:
      phi = register_operand((group_factor * tile_factor * weight).astype(dtype), phi_staging)
      pair_groups.append([(phi, state)])
      accumulators.append(product)
    sums = accumulate_products(pair_groups, tuple(accumulators), init_in_place=not interpreted)
    dx, product = sums[0], (sums[1] if with_product else None)
    ring.refill(block)
    return dx, product

  value_dim = state_ring.shape[-1]
  init = (wgmma_zeros((TILE, head_dim)), wgmma_zeros((TILE, value_dim)) if with_product else None)
  dx, product = lax.fori_loop(0, num_blocks, block_body, init)
  x = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  tiles = [
    (dx, dx_staging, dx_ref.at[batch_head, rows]),
    (0.5 * jnp.sum(x * dx, axis=1), phi_dot_smem, phi_dot_ref.at[batch_head, rows]),
  ]
  if with_product:
    tiles.append((product, product_staging, product_ref.at[batch_head, rows]))
  store_tiles(tiles)


def state_gradient(
  x,
  cotangent,
  cotangent_normalizer,
  state,
  normalizer,
  *,
  heads: int,
  kv_heads: int,
  chunk: int,
  with_product: bool = False,
  stages: int = DEFAULT_STAGES,
  interpret: bool = False,
):
  """Gradient through f_i = phi(x_i) . (S c_i + z c^z_i) with S, z the state of x_i's chunk.

  Args:
    x: [B * heads, T, d], bf16 or f16; cotangent c: [B * heads, T, d_v] in x's dtype;
      cotangent_normalizer c^z: [B * heads, T] float32.
    state: [B * kv_heads, n, D, d_v] in x's dtype (tspow layout, 16-feature tiles); normalizer:
      [B * kv_heads, n, D] float32.
    chunk: the chunk length, a multiple of 64 dividing T.
    with_product: also return phi(x_i) S (the forward state product).
    stages: depth of the ring of state blocks.
    interpret: run in Pallas GPU interpret mode (CPU; slow, for tests).

  Returns:
    dx [B * heads, T, d] float32 (d f / d x), f [B * heads, T] float32, and with_product
    phi(x) S [B * heads, T, d_v] float32.

  Raises:
    ValueError: sizes or a dtype the kernel does not take (naming the argument).
  """
  check_inputs(KERNEL, x, value_dim=state.shape[-1], chunk=chunk, stages=stages, state=state, cotangent=cotangent)
  share_identical_kernels()
  return _state_gradient(
    x,
    cotangent,
    cotangent_normalizer.astype(jnp.float32),
    state,
    normalizer.astype(jnp.float32),
    heads=heads,
    kv_heads=kv_heads,
    chunk=chunk,
    with_product=with_product,
    stages=stages,
    interpret=interpret,
  )


# Jitted, so that a model's layers, which call it with equal shapes, share one traced program
# (`pallas_kernels.castle.mosaic` says why).
@functools.partial(jax.jit, static_argnames=("heads", "kv_heads", "chunk", "with_product", "stages", "interpret"))
def _state_gradient(
  x, cotangent, cotangent_normalizer, state, normalizer, *, heads, kv_heads, chunk, with_product, stages, interpret
):
  bh, length, head_dim = x.shape
  value_dim = state.shape[-1]
  dtype = x.dtype
  columns, weights = row_blocks(head_dim)
  staging = lambda: operand_smem((TILE, TILE), dtype) if interpret else None
  out_type = [
    jax.ShapeDtypeStruct((bh, length, head_dim), jnp.float32),
    jax.ShapeDtypeStruct((bh, length), jnp.float32),
  ]
  if with_product:
    out_type.append(jax.ShapeDtypeStruct((bh, length, value_dim), jnp.float32))
  call = launch_grid(
    functools.partial(
      _kernel,
      heads=heads,
      group=heads // kv_heads,
      tiles_per_chunk=chunk // TILE,
      num_blocks=columns.shape[0],
      stages=stages,
      with_product=with_product,
      interpreted=interpret,
    ),
    tuple(out_type),
    [
      operand_smem((TILE, head_dim), dtype),  # the rows x
      operand_smem((TILE, value_dim), dtype),  # their cotangents
      (plgpu.SMEM((TILE,), jnp.float32), plgpu.SMEM((TILE,), jnp.float32)),  # c^z; f's staging
      operand_smem((stages, TILE, value_dim), dtype),  # state blocks
      plgpu.SMEM((stages, TILE), jnp.float32),  # normalizer blocks
      (operand_smem((head_dim, TILE), dtype), operand_smem((head_dim, TILE), dtype)),  # E_group, E_tile
      (
        operand_smem((TILE, head_dim), jnp.float32),  # dx's staging
        operand_smem((TILE, value_dim), jnp.float32) if with_product else None,  # phi(x) S's staging
        (staging(), staging(), staging()),  # M * T, M * G, phi (interpret mode only)
      ),
      (plgpu.Barrier(num_arrivals=3), plgpu.Barrier(num_arrivals=2, num_barriers=stages)),
    ],
    grid=(bh, length // TILE),
    grid_names=("batch_head", "row_tile"),
    interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return call(columns, weights, x, cotangent, cotangent_normalizer, state, normalizer)
