"""Shared memory the GCA kernels ask for, estimated from their tiles, and the budget rule.

Triton stages a product's operands in shared memory, and software pipelining (num_stages
> 1) keeps one buffer per stage of every tile that a loop body loads. A program that asks
for more than the GPU gives one block fails to launch (XLA: "RESOURCE_EXHAUSTED: Shared
memory size limit exceeded"), so the sizes are checked before anything compiles.

What each kernel holds (rows = block_q x heads_per_program of the largest query block,
C = padded_chunk_len keys, d = head_dim, b = bytes of the operand dtype):
  forward           per slot: the slot's K and V tiles, 2 C d b (pipelined); once: the
                    query tile, rows d b, and the probabilities operand, rows C b.
  backward_queries  the same, with the dO tile beside the query tile.
  backward_memory   per (query chunk, slot) pair: the Q and dO tiles of every query block
                    of every head of the kv head's group (the kernel unrolls them in one
                    loop body), 2 padded_query_len group d b, all pipelined together;
                    without pipelining about two query blocks' tiles are live at a time;
                    once: the chunk's K and V, 2 C d b, and two score operands, 2 rows C b.
So the memory side grows with the group and the query chunk, times the stages: 8 query
heads on 2 kv heads at head dim 128, 65-row query chunks (two blocks, 64 + 16 = 80
rows) and bf16 ask for 371,204 bytes with 2 stages (estimated 2 x (2 x 80 x 4 x 128 x 2)
+ 2 x 64 x 128 x 2 + 2 x 64 x 64 x 2 = 376,832), and 106,496 with one.

The estimates were checked against Triton 3.6's allocations for sm_90 of these kernels
(drt_128m's 12 heads x 64 with 63-key chunks, grouped heads at head dim 128 with 64- and
128-key chunks, one to three stages, bf16 and float32): none is more than 16 KiB below the
allocation, most are above it (Triton 3.6 allocated as much for 3 stages as for 2; the
estimates count every stage). The budget's margin below the hardware limit covers the rest
(barriers, layout conversions).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.config_checks import SMALLEST_TILE
from pallas_kernels.gca.config import GcaTritonConfig
from pallas_kernels.gca.triton_kernels import Tiling

# An H100 (sm_90) gives one block at most 227 KiB of shared memory (232,448 bytes, the
# "available" of XLA's error). 200 KiB leaves 27 KiB for what the estimates do not count.
SHARED_MEMORY_BUDGET = 200 * 1024

# Each kernel's num_stages field of GcaTritonConfig.
STAGE_FIELDS = {"forward": "num_stages", "backward_queries": "bwd_num_stages", "backward_memory": "memory_num_stages"}


def estimate(kernel: str, tiling: Tiling, head_dim: int, dtype, num_stages: int) -> int:
  """Bytes of shared memory `kernel` (a key of STAGE_FIELDS) asks for with these tiles."""
  itemsize = jnp.dtype(dtype).itemsize
  rows = tiling.block_q * tiling.heads_per_program
  keys = tiling.padded_chunk_len
  key_value_tiles = 2 * keys * head_dim * itemsize
  query_tile = rows * head_dim * itemsize
  score_tile = rows * keys * itemsize
  if kernel == "forward":
    return num_stages * key_value_tiles + query_tile + score_tile
  if kernel == "backward_queries":
    return num_stages * key_value_tiles + 2 * query_tile + score_tile
  if kernel == "backward_memory":
    if num_stages > 1:
      pair_tiles = num_stages * 2 * tiling.padded_query_len * tiling.group * head_dim * itemsize
    else:
      rows_in_flight = min(tiling.padded_query_len, 2 * tiling.block_q) * tiling.heads_per_program
      pair_tiles = 2 * rows_in_flight * head_dim * itemsize
    return pair_tiles + key_value_tiles + 2 * score_tile
  raise ValueError(f"kernel must be one of {list(STAGE_FIELDS)}, got {kernel!r}")


def fit_stages(config: GcaTritonConfig, tiling: Tiling, head_dim: int, dtype) -> GcaTritonConfig:
  """`config` with the num_stages of each kernel whose estimate exceeds the budget lowered to 1
  (no pipelining: its loads are no longer buffered per stage). Tiles stay as they are, so a
  config whose kernels all fit comes back unchanged."""
  lowered = {
    field: 1
    for kernel, field in STAGE_FIELDS.items()
    if estimate(kernel, tiling, head_dim, dtype, getattr(config, field)) > SHARED_MEMORY_BUDGET
  }
  return dataclasses.replace(config, **lowered) if lowered else config


def over_budget_reason(
  config: GcaTritonConfig, tiling: Tiling, head_dim: int, dtype, kernels=tuple(STAGE_FIELDS)
) -> str | None:
  """Why `config` would ask one of the Triton kernels for more shared memory than the budget (naming
  the field and the fix), or None."""
  for kernel in kernels:
    field = STAGE_FIELDS[kernel]
    stages = getattr(config, field)
    needed = estimate(kernel, tiling, head_dim, dtype, stages)
    if needed > SHARED_MEMORY_BUDGET:
      smallest = dataclasses.replace(tiling, block_q=SMALLEST_TILE, heads_per_program=1)
      if estimate(kernel, smallest, head_dim, dtype, 1) > SHARED_MEMORY_BUDGET:
        fix = "no tiles fit these chunks and head_dim"
      elif stages > 1:
        fix = f"set GcaTritonConfig.{field}=1 (or lower block_rows or heads_per_program)"
      else:
        fix = "lower GcaTritonConfig.block_rows or heads_per_program"
      return (
        f"the GCA {kernel} kernel would ask for about {needed // 1024} KiB of shared memory with "
        f"{field}={stages} ({tiling.block_q * tiling.heads_per_program}-row query tiles, "
        f"{tiling.padded_chunk_len}-key chunks, head_dim {head_dim}, {jnp.dtype(dtype).name}, query heads "
        f"per kv head: {tiling.group}), over the {SHARED_MEMORY_BUDGET // 1024} KiB budget (an H100 block "
        f"gets 227 KiB); {fix}, or use implementation='xla'"
      )
  return None
