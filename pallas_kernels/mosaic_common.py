"""What the Mosaic GPU (Hopper) kernels of CASTLE and GCA share: the shared-memory layout
that TMA writes and wgmma reads, wgmma products, the staging that GPU interpret mode needs
for register operands, reduce-adds into global memory, and kernels run on refs inside
`pl.run_state` so that they stay pure functions.

GPU interpret mode (CPU) runs the kernels' own code but cannot run three things, so these
functions take a flag for them: a wgmma whose left operand is in registers
(`register_operand` stages it through shared memory), a wgmma accumulator that starts from
a value (`products(init_in_place=False)` adds the product afterwards), and TMA reduce-adds
(`reduce_add_tiles(with_tma=False)` reads, adds and writes back, which is exact because
interpret mode runs the grid one program at a time).
"""

from __future__ import annotations

from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

_SWIZZLE_BYTES = 128


def operand_smem(shape, dtype):
  """Shared memory laid out for TMA and wgmma: 8-row tiles one 128-byte swizzle span wide."""
  span = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
  return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, span)), plgpu.SwizzleTransform(_SWIZZLE_BYTES)))


def products(pairs, shape, init=None, *, init_in_place: bool = True):
  """init + sum of a @ b over `pairs` ((a, b) operand pairs), with float32 accumulation
  in one wgmma accumulator of `shape`.

  With `init_in_place` the accumulator starts from `init` (no second register tile);
  GPU interpret mode cannot run a preinitialized accumulator, so there the product
  is added after.
  """

  def accumulate(acc_ref):
    for a, b in pairs:
      plgpu.wgmma(acc_ref, a, b)

  if init is not None and init_in_place:
    return pl.run_state(accumulate)(plgpu.ACC.init(init))

  def product_of(acc_ref):
    accumulate(acc_ref)
    return acc_ref[...]

  product = pl.run_scoped(product_of, plgpu.ACC(shape, jnp.float32))
  return product if init is None else init + product


def accumulate_products(pair_groups, states, *, init_in_place: bool = True):
  """(states[k] + sum of a @ b over pair_groups[k] for each k): several accumulators at
  once, every wgmma issued before the one wait (`products` waits for each accumulator).

  GPU interpret mode cannot start an accumulator from a value; there each group is a
  `products` call, added afterwards.
  """
  if not init_in_place:
    return tuple(products(pairs, state.shape, state, init_in_place=False) for pairs, state in zip(pair_groups, states))

  def accumulate(acc_refs):
    for pairs, acc_ref in zip(pair_groups, acc_refs):
      for a, b in pairs:
        plgpu.wgmma(acc_ref, a, b)

  return pl.run_state(accumulate)(tuple(plgpu.ACC.init(state) for state in states))


def wgmma_zeros(shape):
  """A float32 zero tile in the wgmma accumulator layout (a state's start)."""
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


def observe_last_releases(free_barriers, num_steps, stages: int):
  """Waits for the releases of a ring's last `stages` steps (slot = step mod stages),
  which no later refill waited for: a waiter may not skip a barrier's phase (GPU
  interpret mode checks it). Fewer steps than stages: only those steps' releases."""
  for last in range(stages, 0, -1):

    @pl.when(num_steps >= last)
    def _():
      for free in free_barriers:
        plgpu.barrier_wait(free.at[lax.rem(num_steps - last, stages)])


def matmul(a, b, shape, init=None, *, init_in_place: bool = True):
  """init + a @ b (`products` of one pair)."""
  return products([(a, b)], shape, init, init_in_place=init_in_place)


def run_on_zeroed_refs(call, types):
  """`call(*refs)` (a Mosaic GPU kernel that writes, or reduce-adds into, refs given as its
  last arguments) on zero-filled refs of `types`; returns their final values.

  The refs live inside `pl.run_state`, so that the whole is a pure function seen from
  outside. A kernel writing refs made by `jax.new_ref` instead is dropped by
  `jax.checkpoint` (jax 0.11.2) when the recomputation needs none of its other outputs:
  the refs then read back as zeros, and the rematerialized attention came out 0 / 0.
  """

  def body(refs):
    call(*refs)

  return pl.run_state(body)(tuple(jnp.zeros(t.shape, t.dtype) for t in types))


def register_operand(x, staging_smem):
  """x as a wgmma left operand: from registers on the GPU; GPU interpret mode only
  multiplies shared-memory operands, so there x goes through `staging_smem`."""
  if staging_smem is None:
    return x
  staging_smem[...] = x
  plgpu.commit_smem()
  return staging_smem


def reduce_add_tiles(tiles, barrier, *, with_tma: bool):
  """gmem += tile for each (tile, gmem, staging) in `tiles` (float32 tiles, staged through
  the shared-memory buffers `staging`).

  On the GPU a TMA reduce-add each. GPU interpret mode has none, but runs the grid one
  program at a time, so there it reads, adds and writes back; `barrier` then needs one
  arrival per tile.
  """
  # The previous reduce-adds must have read the staging buffers.
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if with_tma:
    for tile, _, staging in tiles:
      staging[...] = tile
    plgpu.commit_smem()
    for _, gmem, staging in tiles:
      plgpu.copy_smem_to_gmem(staging, gmem, reduction_op="add")
    return
  for _, gmem, staging in tiles:
    plgpu.copy_gmem_to_smem(gmem, staging, barrier)
  plgpu.barrier_wait(barrier)
  for tile, _, staging in tiles:
    staging[...] = staging[...] + tile
  plgpu.commit_smem()
  for _, gmem, staging in tiles:
    plgpu.copy_smem_to_gmem(staging, gmem)
