"""Hybrid tree attention (LongSpec §3.3) as a Pallas Mosaic GPU (Hopper: wgmma + TMA) kernel.

The math is the Triton kernel's (`pallas_kernels.tree_attention.triton`, whose docstring
derives it): split-K flash decoding over the cache's filled slots, the tree's drafted keys
folded into the last split under the tree mask, the splits' partial states (running max,
sum, unnormalized output) merged in XLA by `merge_split_states`.

Schedule, for LLM heads (e.g. 32 query / 8 KV heads of 128, trees of ~69 nodes): the
nodes times the heads sharing a KV head are the query rows of that KV head (row r = node
r // group, head r % group), cut into 64-row tiles (one wgmma's rows). One program per
(batch, KV head, split, row group) runs `consumers` warpgroups, each owning one tile's
softmax state in registers, and one producer warpgroup that streams the split's cache
blocks, then (last split only) the tree's key blocks, through a `stages`-deep ring of
shared-memory K and V buffers with TMA. Every consumer reads every buffer, so a row group
reads its cache range once, whatever its number of tiles; 276 rows (69 nodes x 4 heads)
take 5 tiles in 3 row groups of 2 consumers with 128-key blocks (by default; `default_config`),
against 5 row blocks of the Triton kernel. A consumer whose tile holds only padding rows (the
last group's second, there) runs no products: it only releases each ring slot as it is filled. Per step and
consumer: S = Q K^T (wgmma, shared x shared^T), the online softmax in float32 and base 2,
then out += P V (wgmma, P from registers). K and V have separate barriers, so the score
product waits only for K; a buffer is refilled once every consumer has released it.

Work follows the filled length: a split's blocks are its share of ceil(length /
block_keys), and the blocks of full slots run without a mask. The last block of a partly
filled cache is masked by position; when it would run past the capacity it is loaded
ending at the capacity instead (a TMA box must lie inside the array, and a padded copy of
the cache would cost a pass over it) and the slots before the block are masked out.
Slots past the length inside that last block are loaded: their scores are replaced by
-inf (so NaN keys are harmless) and their values enter P V with weight 0 (finite garbage
is harmless; inf or NaN values there would not be). TMA copies of the cache into 8-row
tiles need a capacity that is a multiple of 8 (checked); a cache smaller than one block
is padded to one (a copy of under 64 slots per row).

Why row groups instead of all rows in one program: each 64-row tile keeps a [64,
head_dim] float32 accumulator in its warpgroup's registers (64 registers per thread at
head dim 128, plus the score tile), and the register file holds about three such
warpgroups besides the producer; `consumers` sets the trade-off between cache passes and
registers per warpgroup.

The tree mask enters as an additive bias tile (0 or -inf, bfloat16) per consumer and tree
block, [64, block_keys], built in XLA from the node mask repeated per head.

GPU interpret mode (CPU) runs the same code except in two places (`mosaic_common`): the
register operand P goes through shared memory (`register_operand`), and P V is added to
the accumulator after the wgmma instead of accumulated in place. Each warpgroup is a
thread there; tests/conftest.py sets the XLA flag that keeps them from starving.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.mosaic_common import observe_last_releases, operand_smem, products, register_operand, wgmma_zeros
from pallas_kernels.mosaic_compiler_params import compiler_params
from pallas_kernels.mosaic_kernel_cache import share_identical_kernels
from pallas_kernels.split_k import merge_split_states, split_blocks
from pallas_kernels.tree_attention.rows import heads_of_rows, rows_of_heads, tree_mask_rows
from pallas_kernels.tree_attention.config import (
  MOSAIC_TILE_ROWS,
  PRODUCER_REGISTERS,
  TreeAttentionMosaicConfig,
)

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
# The H100's shared memory per block (227 KiB), less a margin for barriers and alignment.
SHARED_MEMORY_LIMIT = 227 * 1024 - 1024
_LOG2_E = math.log2(math.e)
_LN_2 = math.log(2.0)
# TMA copies of the cache into 8-row tiles need a capacity that is a multiple of 8.
CAPACITY_ALIGNMENT = 8
# The tree-mask bias: 0 where a row sees a node, -inf elsewhere (exact in bfloat16).
_BIAS_DTYPE = jnp.bfloat16


def tree_blocks(n: int, block_keys: int) -> int:
  """Key blocks of a tree of n nodes (padded with invisible nodes)."""
  return -(-n // block_keys)


def shared_memory_bytes(head_dim: int, tree_nodes: int, dtype, config: TreeAttentionMosaicConfig) -> int:
  """Shared memory of one program's buffers (the lowering adds barriers and alignment)."""
  itemsize = jnp.dtype(dtype).itemsize
  tile = MOSAIC_TILE_ROWS
  ring = 2 * config.stages * config.block_keys * head_dim * itemsize
  query = config.consumers * tile * head_dim * itemsize
  # Per consumer, the tree bias and the output's staging share one buffer (every bias is
  # dead before any output is written), plus the row maxima and sums.
  bias = max(tree_blocks(tree_nodes, config.block_keys), 1) * tile * config.block_keys * jnp.dtype(_BIAS_DTYPE).itemsize
  staging = tile * head_dim * 4
  return ring + query + config.consumers * (max(bias, staging) + 2 * tile * 4)


# The default tilings, in order of preference: the first whose buffers fit shared memory.
# Three consumers with a 2-deep ring measured faster than two with a 3-deep ring at 32/8 and
# 64/8 heads of 128 with a 69-node tree (benchmarks/RESULTS.md, hybrid tree attention); a large
# tree's mask bias leaves no room for three.
_PREFERRED_CONFIGS = (TreeAttentionMosaicConfig(consumers=3, stages=2), TreeAttentionMosaicConfig())
# Two consumers with 128-key blocks (232 registers each instead of 152) per row group cost about
# two thirds of three with 64-key blocks at heads of 128: faster where they need at most 1.5x the
# row groups (32/8 heads x 69 nodes: 5 tiles in 3 groups against 2), slower beyond (64/8: 9 tiles
# in 5 groups against 3) and at heads of 64 (benchmarks/RESULTS.md, hybrid tree attention). Measured
# at batch 1, where each row group still had 5 splits; with few splits (larger batches) their extra
# row group leaves SMs idle, so they need room for at least this many.
_WIDE_KEY_BLOCKS = TreeAttentionMosaicConfig(block_keys=128, consumers=2, stages=2)
_WIDE_KEY_BLOCKS_HEAD_DIM = 128
_WIDE_KEY_BLOCKS_MIN_SPLITS = 4


def default_config(
  *, head_dim: int, heads_per_kv_head: int, tree_nodes: int, dtype, batch_kv_heads: int = 1
) -> TreeAttentionMosaicConfig:
  """The tiling the kernel runs when none is given.

  Three consumers only pay when a KV head's rows fill more than two 64-row tiles (fewer would
  leave a consumer on padding rows); at head dim 128, two with 128-key blocks instead where they
  need at most 1.5x the row groups of three and still get 4 splits each; otherwise, and when these
  do not fit shared memory, the dataclass's defaults.

  Args:
    head_dim: the last axis of q.
    heads_per_kv_head: query heads sharing one KV head.
    tree_nodes: n for `tree_attention`, 0 for the cache part alone.
    dtype: q's dtype.
    batch_kv_heads: batch size times KV heads (the programs per split and row group).
  """
  rows = max(tree_nodes, 1) * heads_per_kv_head
  if rows > 2 * MOSAIC_TILE_ROWS:
    tiles = -(-rows // MOSAIC_TILE_ROWS)
    row_groups = lambda config: -(-tiles // config.consumers)
    wide, three = _WIDE_KEY_BLOCKS, _PREFERRED_CONFIGS[0]
    if (
      head_dim == _WIDE_KEY_BLOCKS_HEAD_DIM
      and row_groups(wide) <= 1.5 * row_groups(three)
      and batch_kv_heads * row_groups(wide) * _WIDE_KEY_BLOCKS_MIN_SPLITS <= wide.target_programs
      and shared_memory_bytes(head_dim, tree_nodes, dtype, wide) <= SHARED_MEMORY_LIMIT
    ):
      return wide
    for config in _PREFERRED_CONFIGS:
      if shared_memory_bytes(head_dim, tree_nodes, dtype, config) <= SHARED_MEMORY_LIMIT:
        return config
  return _PREFERRED_CONFIGS[-1]


def unsupported_reason(
  *,
  head_dim: int,
  dtype,
  kv_dtypes,
  tree_nodes: int,
  capacity: int,
  config: TreeAttentionMosaicConfig | None = None,
) -> str | None:
  """Why the kernel cannot take these inputs (naming the argument, the value and the fix), or None.

  Args:
    head_dim: the last axis of q.
    dtype, kv_dtypes: q's dtype; the dtypes of cache_k, cache_v (and tree_k, tree_v).
    tree_nodes: n for `tree_attention`, 0 for the cache part alone.
    capacity: cache slots (axis 1 of cache_k).
    config: the tiling (None: the default).
  """
  config = config or TreeAttentionMosaicConfig()
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"the Mosaic kernel takes q in {[jnp.dtype(d).name for d in SUPPORTED_DTYPES]} (wgmma's 16-bit "
      f"operands), got dtype {jnp.dtype(dtype).name}; cast q and the keys and values, or use "
      "implementation='triton'"
    )
  others = sorted({jnp.dtype(d).name for d in kv_dtypes} - {jnp.dtype(dtype).name})
  if others:
    return (
      f"the Mosaic kernel takes cache_k, cache_v, tree_k and tree_v in q's dtype {jnp.dtype(dtype).name}, "
      f"got {others}; cast them or use implementation='triton'"
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return (
      f"the Mosaic kernel takes head_dim in {SUPPORTED_HEAD_DIMS} (last axis of q), got {head_dim}; "
      "use implementation='triton'"
    )
  if capacity >= config.block_keys and capacity % CAPACITY_ALIGNMENT:
    return (
      f"the Mosaic kernel needs a cache capacity (axis 1 of cache_k) that is a multiple of "
      f"{CAPACITY_ALIGNMENT} (TMA copies of 8-row tiles), got {capacity}; allocate the cache with its capacity "
      f"rounded up to a multiple of {CAPACITY_ALIGNMENT}, or use implementation='triton'"
    )
  needed = shared_memory_bytes(head_dim, tree_nodes, dtype, config)
  if needed > SHARED_MEMORY_LIMIT:
    return (
      f"the Mosaic kernel's buffers for n={tree_nodes} tree nodes and head_dim={head_dim} take {needed} bytes "
      f"of shared memory, over {SHARED_MEMORY_LIMIT}; use fewer stages or consumers in "
      "TreeAttentionMosaicConfig, or implementation='triton'"
    )
  return None


def _kernel(
  lengths_ref,
  q_ref,
  cache_k_ref,
  cache_v_ref,
  *refs,
  scale: float,
  block_keys: int,
  splits: int,
  stages: int,
  consumers: int,
  consumer_registers: int,
  tree_steps: int,
  tiles: int,
  row_groups: int,
  interpreted: bool,
):
  """One program: `consumers` 64-row tiles of one (batch, KV head), one split of the cache;
  of the KV head's `tiles` tiles (rows with queries), a last row group's consumers past them idle."""
  if tree_steps:
    tree_k_ref, tree_v_ref, bias_ref, *refs = refs
  acc_ref, max_ref, sum_ref, query_smem, key_ring, value_ring, outputs, row_states, probs_staging, barriers = refs
  query_full, key_full, value_full, key_free, value_free, bias_full, tree_done = barriers
  bias_smem, staging_smem = outputs
  batch = lax.axis_index("batch")
  kv_head = lax.axis_index("kv_head")
  split = lax.axis_index("split")
  row_group = lax.axis_index("row_group")
  warpgroup = lax.axis_index("wg")
  capacity = cache_k_ref.shape[1]
  length = lengths_ref[batch]
  first, stop = split_blocks(length, split, splits=splits, block=block_keys)
  cache_steps = jnp.maximum(stop - first, 0)
  is_last_split = split == splits - 1
  num_steps = cache_steps + jnp.where(is_last_split, tree_steps, 0)

  def cache_start(block):
    # A TMA box must lie inside the array: a last block past the capacity is loaded ending
    # there, its earlier slots masked.
    return jnp.minimum(block * block_keys, capacity - block_keys)

  @pl.when(warpgroup == consumers)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    @pl.loop(0, num_steps)
    def _load(step):
      slot = lax.rem(step, stages)
      cache_slots = (batch, pl.ds(cache_start(first + step), block_keys), kv_head)
      tree_nodes = (batch, pl.ds((step - cache_steps) * block_keys, block_keys), kv_head)

      def refill(ring, full, free, cache_ref, tree_ref):
        # Keys are released after the score product, values after the output product: the
        # next keys load while the consumers still multiply by this step's values.
        @pl.when(step >= stages)
        def _():
          plgpu.barrier_wait(free.at[slot])

        @pl.when(step < cache_steps)
        def _():
          plgpu.copy_gmem_to_smem(cache_ref.at[cache_slots], ring.at[slot], full.at[slot])

        if tree_steps:

          @pl.when(step >= cache_steps)
          def _():
            plgpu.copy_gmem_to_smem(tree_ref.at[tree_nodes], ring.at[slot], full.at[slot])

      refill(key_ring, key_full, key_free, cache_k_ref, tree_k_ref if tree_steps else None)
      refill(value_ring, value_full, value_free, cache_v_ref, tree_v_ref if tree_steps else None)

    observe_last_releases([key_free, value_free], num_steps, stages)

  tile = row_group * consumers + warpgroup  # the consumers' tile (the producer's is past them)

  if row_groups * consumers > tiles:

    @pl.when((warpgroup < consumers) & (tile >= tiles))
    def _idle_consumer():
      # The same register split as the busy consumers': every warpgroup of the program runs it.
      plgpu.set_max_registers(consumer_registers, action="increase")

      # A tile of padding rows only: no products, but the ring's slots are refilled once every
      # consumer has released them, so it releases each one as it is filled.
      @pl.loop(0, num_steps)
      def _release(index):
        slot = lax.rem(index, stages)
        plgpu.barrier_wait(key_full.at[slot])
        plgpu.barrier_arrive(key_free.at[slot])
        plgpu.barrier_wait(value_full.at[slot])
        plgpu.barrier_arrive(value_free.at[slot])

      plgpu.barrier_arrive(tree_done)
      plgpu.barrier_wait(tree_done)

  @pl.when((warpgroup < consumers) & (tile < tiles))
  def _consumer():
    plgpu.set_max_registers(consumer_registers, action="increase")
    rows = pl.ds(tile * MOSAIC_TILE_ROWS, MOSAIC_TILE_ROWS)
    query = query_smem.at[warpgroup]
    bias = bias_smem.at[warpgroup]
    plgpu.copy_gmem_to_smem(q_ref.at[batch, kv_head, rows], query, query_full.at[warpgroup])
    if tree_steps:

      @pl.when(is_last_split)
      def _():
        plgpu.copy_gmem_to_smem(bias_ref.at[batch, :, rows], bias, bias_full.at[warpgroup])

    staging_p = None if probs_staging is None else probs_staging.at[warpgroup]
    shape = (MOSAIC_TILE_ROWS, block_keys)
    head_dim = query.shape[-1]
    dtype = query.dtype
    plgpu.barrier_wait(query_full.at[warpgroup])

    def step(index, carry, *, kind: str):
      running_max, running_sum, acc = carry
      slot = lax.rem(index, stages)
      plgpu.barrier_wait(key_full.at[slot])
      scores = products([(query, key_ring.at[slot].T)], shape)
      plgpu.barrier_arrive(key_free.at[slot])
      # Base-2 units: exp2 is the GPU's native exponential.
      scores = scores * (scale * _LOG2_E)
      if kind == "partial":
        block = first + index
        slot_of = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA) + cache_start(block)
        visible = (slot_of >= block * block_keys) & (slot_of < length)
        scores = jnp.where(visible, scores, -jnp.inf)
      elif kind == "tree":
        tree_bias = plgpu.load(bias.at[index - cache_steps], (), layout=plgpu.Layout.WGMMA)
        scores = scores + tree_bias.astype(jnp.float32)
      new_max = jnp.maximum(running_max, scores.max(axis=1))
      # A row that has seen nothing keeps max -inf: shift it by 0 so that exp2(-inf) stays 0, not NaN.
      shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
      correction = jnp.exp2(running_max - shift)
      probs = jnp.exp2(scores - lax.broadcast_in_dim(shift, shape, [0]))
      running_sum = running_sum * correction + probs.sum(axis=1)
      acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
      operand = register_operand(probs.astype(dtype), staging_p)
      plgpu.barrier_wait(value_full.at[slot])
      acc = products([(operand, value_ring.at[slot])], acc.shape, init=acc, init_in_place=not interpreted)
      plgpu.barrier_arrive(value_free.at[slot])
      return new_max, running_sum, acc

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    carry = (
      plgpu.layout_cast(jnp.full((MOSAIC_TILE_ROWS,), -jnp.inf, jnp.float32), row_layout),
      plgpu.layout_cast(jnp.zeros((MOSAIC_TILE_ROWS,), jnp.float32), row_layout),
      wgmma_zeros((MOSAIC_TILE_ROWS, head_dim)),
    )
    # Blocks wholly below the length need no mask; at most the split's last one is partial.
    full_steps = jnp.clip(lax.div(length, block_keys) - first, 0, cache_steps)
    carry = lax.fori_loop(0, full_steps, functools.partial(step, kind="full"), carry)
    carry = lax.fori_loop(full_steps, cache_steps, functools.partial(step, kind="partial"), carry)
    if tree_steps:

      @pl.when(is_last_split)
      def _():
        plgpu.barrier_wait(bias_full.at[warpgroup])

      carry = lax.fori_loop(cache_steps, num_steps, functools.partial(step, kind="tree"), carry)
    running_max, running_sum, acc = carry

    # The staging aliases every consumer's bias: all must be past the tree.
    plgpu.barrier_arrive(tree_done)
    plgpu.barrier_wait(tree_done)
    staging = staging_smem.at[warpgroup]
    # merge_split_states takes natural-log maxima; the sums are the same in either base.
    max_smem, sum_smem = row_states.at[0, warpgroup], row_states.at[1, warpgroup]
    staging[...] = acc
    max_smem[...] = running_max * _LN_2
    sum_smem[...] = running_sum
    plgpu.commit_smem()
    state = (split, batch, kv_head, rows)
    plgpu.copy_smem_to_gmem(staging, acc_ref.at[state])
    plgpu.copy_smem_to_gmem(max_smem, max_ref.at[state])
    plgpu.copy_smem_to_gmem(sum_smem, sum_ref.at[state])
    plgpu.wait_smem_to_gmem(0)


def _scratch(*, head_dim: int, dtype, tree_steps: int, config: TreeAttentionMosaicConfig, interpreted: bool):
  """Shared memory and barriers of `_kernel`."""
  tile, block_keys, stages, consumers = MOSAIC_TILE_ROWS, config.block_keys, config.stages, config.consumers
  # The consumers' tree biases, then (aliased: every consumer is past the tree by then,
  # `tree_done`) their outputs' staging; and their row maxima and sums.
  outputs = plgpu.RefUnion(
    plgpu.SMEM((consumers, max(tree_steps, 1), tile, block_keys), _BIAS_DTYPE),
    plgpu.SMEM((consumers, tile, head_dim), jnp.float32),
  )
  row_states = plgpu.SMEM((2, consumers, tile), jnp.float32)
  return [
    operand_smem((consumers, tile, head_dim), dtype),
    operand_smem((stages, block_keys, head_dim), dtype),
    operand_smem((stages, block_keys, head_dim), dtype),
    outputs,
    row_states,
    operand_smem((consumers, tile, block_keys), dtype) if interpreted else None,  # P (interpret mode only)
    (
      plgpu.Barrier(num_arrivals=1, num_barriers=consumers),  # query_full
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # key_full
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # value_full
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # key_free
      plgpu.Barrier(num_arrivals=consumers, num_barriers=stages),  # value_free
      plgpu.Barrier(num_arrivals=1, num_barriers=consumers),  # bias_full
      plgpu.Barrier(num_arrivals=consumers),  # tree_done
    ),
  ]


def _splits(other_programs: int, capacity: int, config: TreeAttentionMosaicConfig) -> int:
  if config.splits is not None:
    return config.splits
  # Rounded down: a program fills an SM's shared memory, so programs past `target_programs`
  # (the SMs) would run as a second, mostly idle wave.
  by_occupancy = config.target_programs // other_programs
  by_length = max(1, capacity // (2 * config.block_keys))
  return max(1, min(by_occupancy, by_length))


def tree_attention_mosaic(
  q: jax.Array,
  cache_k: jax.Array,
  cache_v: jax.Array,
  cache_length: jax.Array,
  tree_k: jax.Array | None = None,
  tree_v: jax.Array | None = None,
  tree_mask: jax.Array | None = None,
  *,
  config: TreeAttentionMosaicConfig | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Attention of n queries over a cache's filled slots and, optionally, a masked tree of n nodes.

  The public entry points (`castle_jax.ops.tree_attention`) check the shapes; this checks
  what the kernel itself needs (`unsupported_reason`).

  Args:
    q: [batch, n, heads, head_dim], bfloat16 or float16, head_dim 64 or 128.
    cache_k, cache_v: [batch, capacity, kv_heads, head_dim] in q's dtype; heads % kv_heads == 0;
      capacity a multiple of 8 or under block_keys.
    cache_length: int32 scalar or [batch], filled slots (may be traced).
    tree_k, tree_v: [batch, n, kv_heads, head_dim] in q's dtype, or None (the cache part alone).
    tree_mask: bool [batch, n, n] or [n, n]; [i, j] True iff node i sees node j.
    config: tiling; default `default_config(...)` for these shapes.
    interpret: run in Pallas GPU interpret mode (CPU tests).

  Returns:
    out: [batch, n, heads, head_dim] in q's dtype (0 for a row that sees no key);
    lse: float32 [batch, n, heads] (-inf for a row that sees no key).

  Raises:
    ValueError: a dtype, head dim or tree the kernel does not take (naming it and the fix).
  """
  batch, n, heads, head_dim = q.shape
  _, capacity, kv_heads, _ = cache_k.shape
  tree_nodes = 0 if tree_k is None else n
  config = config or default_config(
    head_dim=head_dim,
    heads_per_kv_head=heads // kv_heads,
    tree_nodes=tree_nodes,
    dtype=q.dtype,
    batch_kv_heads=batch * kv_heads,
  )
  reason = unsupported_reason(
    head_dim=head_dim,
    dtype=q.dtype,
    kv_dtypes=[x.dtype for x in (cache_k, cache_v, tree_k, tree_v) if x is not None],
    tree_nodes=tree_nodes,
    capacity=capacity,
    config=config,
  )
  if reason:
    raise ValueError(reason)
  block_keys, consumers = config.block_keys, config.consumers
  group = heads // kv_heads
  rows = n * group
  tiles = -(-rows // MOSAIC_TILE_ROWS)
  row_groups = -(-tiles // consumers)
  padded_rows = row_groups * consumers * MOSAIC_TILE_ROWS
  q_rows = rows_of_heads(q, kv_heads, padded_rows)
  lengths = jnp.broadcast_to(jnp.asarray(cache_length, jnp.int32), (batch,))
  if capacity < block_keys:
    # A cache smaller than one block: padded (a copy of under block_keys slots per row).
    padding = ((0, 0), (0, block_keys - capacity), (0, 0), (0, 0))
    cache_k, cache_v = jnp.pad(cache_k, padding), jnp.pad(cache_v, padding)
    capacity = block_keys
  splits = _splits(batch * kv_heads * row_groups, capacity, config)
  inputs = [lengths, q_rows, cache_k, cache_v]
  tree_steps = 0
  if tree_nodes:
    tree_steps = tree_blocks(n, block_keys)
    padded_nodes = tree_steps * block_keys
    node_padding = ((0, 0), (0, padded_nodes - n), (0, 0), (0, 0))
    # [batch, tree_steps, padded_rows, block_keys], so that a consumer's bias of one tree
    # block is one contiguous [64, block_keys] tile.
    mask = tree_mask_rows(tree_mask, batch, group, padded_rows, padded_nodes)
    bias = jnp.where(mask, 0.0, -jnp.inf).astype(_BIAS_DTYPE)
    bias = bias.reshape(batch, padded_rows, tree_steps, block_keys).transpose(0, 2, 1, 3)
    inputs += [jnp.pad(tree_k, node_padding), jnp.pad(tree_v, node_padding), bias]

  kernel = functools.partial(
    _kernel,
    scale=head_dim**-0.5,
    block_keys=block_keys,
    splits=splits,
    stages=config.stages,
    consumers=consumers,
    consumer_registers=config.consumer_registers,
    tree_steps=tree_steps,
    tiles=tiles,
    row_groups=row_groups,
    interpreted=interpret,
  )
  state = jax.ShapeDtypeStruct((splits, batch, kv_heads, padded_rows), jnp.float32)
  out_type = (jax.ShapeDtypeStruct((splits, batch, kv_heads, padded_rows, head_dim), jnp.float32), state, state)
  share_identical_kernels()
  accs, maxima, sums = plgpu.kernel(
    kernel,
    out_type=out_type,
    scratch_types=_scratch(
      head_dim=head_dim, dtype=q.dtype, tree_steps=tree_steps, config=config, interpreted=interpret
    ),
    # The row groups launch fastest: programs in flight at once read the same cache range.
    grid=(batch, kv_heads, splits, row_groups),
    grid_names=("batch", "kv_head", "split", "row_group"),
    num_threads=consumers + 1,
    thread_name="wg",
    # Row maxima and sums reduce a WGMMA tile along its columns, within a warp: the 2 KB of
    # cross-warp reduction scratch go to the buffers instead.
    compiler_params=compiler_params(warp_local_reductions=True),
    interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*inputs)
  out, lse = merge_split_states(maxima, sums, accs)
  return heads_of_rows(out, n, heads).astype(q.dtype), heads_of_rows(lse, n, heads)
