"""What power attention's Mosaic GPU kernels share: sizes and input checks, the ring that streams
64-row tiles by TMA, a program's kv head, the row blocks of phi and their 0/1 selections.

Every kernel runs one warpgroup per program on 64-row tiles (one warpgroup's wgmma rows) and
streams the tiles it walks (key tiles, token tiles or state blocks) through a `stages`-deep ring
of shared-memory buffers, each step's copies on one barrier, refilled `stages` steps ahead.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.power.config import FEATURE_TILE
from pallas_kernels.power.triton_kernels import tile_pairs

TILE = 64  # rows of every tile: one warpgroup's wgmma rows; also the expanded features per row block
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
DEFAULT_STAGES = 2


def unsupported_reason(
  kernels: str = "the power-attention Mosaic GPU kernels",
  *,
  head_dim: int,
  value_dim: int,
  dtype,
  chunk: int,
  stages: int = DEFAULT_STAGES,
) -> str | None:
  """Why `kernels` cannot take these sizes (naming the argument and the fix), or None."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"{kernels} take {[jnp.dtype(d).name for d in SUPPORTED_DTYPES]} (wgmma's 16-bit operands), got "
      f"{jnp.dtype(dtype).name}; use the Triton kernels"
    )
  for name, size in (("head_dim", head_dim), ("value_dim", value_dim)):
    if size not in SUPPORTED_HEAD_DIMS:
      return f"{kernels} take {name} in {SUPPORTED_HEAD_DIMS}, got {size}; use the Triton kernels"
  if chunk % TILE:
    return f"{kernels} need a chunk that is a multiple of {TILE}, got {chunk}"
  if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
    return f"stages must be an int >= 1 (ring depth), got {stages!r}"
  return None


def check_inputs(kernels: str, rows, *, value_dim: int, chunk: int, stages: int, **same_dtype):
  """ValueError unless `kernels` take rows [BH, T, d] with a value dim, chunk and ring depth, T a
  multiple of the chunk and every array of `same_dtype` (name=array) in rows' dtype."""
  length, head_dim = rows.shape[1:]
  reason = unsupported_reason(
    kernels, head_dim=head_dim, value_dim=value_dim, dtype=rows.dtype, chunk=chunk, stages=stages
  )
  if reason:
    raise ValueError(reason)
  if length % chunk:
    raise ValueError(f"the sequence ({length}, axis 1) must be a multiple of chunk ({chunk})")
  for name, array in same_dtype.items():
    if array.dtype != rows.dtype:
      raise ValueError(f"{name} must be in the rows' dtype {rows.dtype}, got {array.dtype}")


def kv_head(batch_head, *, heads: int, group: int):
  """The batch * kv-head index of a batch * head index (a kv head's query heads are consecutive)."""
  return lax.div(batch_head, heads) * (heads // group) + lax.div(lax.rem(batch_head, heads), group)


class Ring:
  """Tiles streamed through `stages`-deep rings of shared-memory buffers.

  `sources(step)` gives the step's global-memory tiles, one per ring in `buffers` (each
  [stages, ...]); all of a step's copies arrive on `barriers.at[step % stages]`. `start()` issues
  the first steps, `wait(step)` returns the step's stage once its tiles are in, `refill(step)`
  (once the step's products are done) issues step + stages.
  """

  def __init__(self, sources, buffers, barriers, *, num_steps, stages: int):
    self.sources, self.buffers, self.barriers = sources, buffers, barriers
    self.num_steps, self.stages = num_steps, stages

  def _load(self, step):
    stage = lax.rem(step, self.stages)
    for source, buffer in zip(self.sources(step), self.buffers):
      plgpu.copy_gmem_to_smem(source, buffer.at[stage], self.barriers.at[stage])

  def start(self):
    for step in range(self.stages):
      step = jnp.int32(step)
      pl.when(step < self.num_steps)(functools.partial(self._load, step))

  def wait(self, step):
    stage = lax.rem(step, self.stages)
    plgpu.barrier_wait(self.barriers.at[stage])
    return stage

  def refill(self, step):
    pl.when(step + self.stages < self.num_steps)(functools.partial(self._load, step + self.stages))


def store_tiles(tiles):
  """gmem = value for each (value, staging, gmem): written into the shared-memory staging
  buffers, committed once, copied out by TMA and waited for (a program's epilogue)."""
  for value, staging, _ in tiles:
    staging[...] = value
  plgpu.commit_smem()
  for _, staging, gmem in tiles:
    plgpu.copy_smem_to_gmem(staging, gmem)
  plgpu.wait_smem_to_gmem(0)


def state_block_ring(state_ref, normalizer_ref, buffers, barriers, *, batch_kv_head, chunk, num_blocks, stages):
  """The ring of a chunk's state and normalizer, one 64-feature row block of phi a step."""
  features = lambda block: pl.ds(block * TILE, TILE)
  return Ring(
    lambda block: (
      state_ref.at[batch_kv_head, chunk, features(block)],
      normalizer_ref.at[batch_kv_head, chunk, features(block)],
    ),
    buffers,
    barriers,
    num_steps=num_blocks,
    stages=stages,
  )


def row_blocks(head_dim: int) -> tuple[jax.Array, jax.Array]:
  """int32 [blocks, 2] (first column of the a-group, first column of tile t) and float32 [blocks]
  weights of phi's 64-feature row blocks, in the tspow layout's order (pair, then a, then b)."""
  groups = FEATURE_TILE * FEATURE_TILE // TILE  # a-groups of a tile pair
  features = TILE // FEATURE_TILE  # features a per a-group
  columns, weights = [], []
  for s, t, weight in tile_pairs(head_dim):
    for group in range(groups):
      columns.append((s * FEATURE_TILE + group * features, t * FEATURE_TILE))
      weights.append(weight)
  return jnp.asarray(columns, jnp.int32), jnp.asarray(weights, jnp.float32)


def selections(first_col, tile_col, shape: tuple[int, int], *, features_axis: int, dtype):
  """(E_group, E_tile), 0/1 in the WGMMA layout: with x's d features along `features_axis` of
  `shape` and a row block's 64 columns c along the other, E_group picks feature
  first_col + c // 16 and E_tile feature tile_col + c % 16, so that phi = (x E_group) * (x E_tile)."""
  feature = plgpu.broadcasted_iota(jnp.int32, shape, features_axis, layout=plgpu.Layout.WGMMA)
  column = plgpu.broadcasted_iota(jnp.int32, shape, 1 - features_axis, layout=plgpu.Layout.WGMMA)
  pick = lambda picked: jnp.where(feature == picked, 1.0, 0.0).astype(dtype)
  return pick(first_col + column // FEATURE_TILE), pick(tile_col + column % FEATURE_TILE)


def store_selections(selections_smem, first_col, tile_col, *, dtype):
  """Writes a row block's (E_group, E_tile) [d, 64] into shared memory (the products' right operands)."""
  group_smem, tile_smem = selections_smem
  for smem, selection in zip(
    selections_smem, selections(first_col, tile_col, group_smem.shape, features_axis=0, dtype=dtype)
  ):
    smem[...] = selection
  plgpu.commit_smem()
  return group_smem, tile_smem
