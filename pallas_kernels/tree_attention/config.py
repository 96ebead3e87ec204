"""Tiling of the hybrid tree attention kernels (`pallas_kernels.tree_attention.triton`, `.mosaic`)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields, parse_config


@dataclasses.dataclass(frozen=True)
class TreeAttentionTritonConfig:
  """How the kernel tiles its work.

  The n drafted nodes times the heads that share one KV head form the query rows of a
  KV head; one program takes `block_rows` of them and one split of the filled cache,
  sweeping it in blocks of `block_keys` slots. The programs of a KV head read the same
  cache blocks, mostly from L2.

  Attributes:
    block_rows: query rows per program (a power of two >= 16); None: the rows of one KV
      head rounded up to a power of two, at most 64.
    block_keys: cache slots per step (a power of two >= 16).
    splits: programs along the cache per (row block, batch, KV head); None: enough for
      ~`target_programs` programs, each with at least 2 blocks of a full cache.
    target_programs: what the default split count aims for.
    num_warps, num_stages: Triton launch parameters.
  """

  block_rows: int | None = None
  # 128: measured faster than 64 on an H100 (benchmarks/RESULTS.md, tree attention).
  block_keys: int = 128
  splits: int | None = None
  target_programs: int = 256
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    skip = tuple(name for name in ("block_rows", "splits") if getattr(self, name) is None)
    check_int_fields(
      self,
      power_of_two=tuple(name for name in ("block_rows", "block_keys", "num_warps") if name not in skip),
      tiles=tuple(name for name in ("block_rows", "block_keys") if name not in skip),
      skip=skip,
    )

  @classmethod
  def from_string(cls, text: str) -> "TreeAttentionTritonConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)


# Query rows of one wgmma: each consumer warpgroup of the Mosaic kernel owns one such tile.
MOSAIC_TILE_ROWS = 64
# Hopper's register file (64K 32-bit registers per SM) shared by the warpgroups of a program.
_REGISTERS_PER_THREAD_SLOT = 512
# Registers per thread of the Mosaic kernel's producer warpgroup: it only issues TMA copies.
PRODUCER_REGISTERS = 40


@dataclasses.dataclass(frozen=True)
class TreeAttentionMosaicConfig:
  """How the Mosaic GPU (Hopper) kernel tiles its work (`pallas_kernels.tree_attention.mosaic`).

  The n drafted nodes times the heads that share one KV head form the query rows of a KV
  head, cut into 64-row tiles. One program has `consumers` warpgroups, each owning one
  tile's softmax state in registers, and a producer warpgroup that streams the program's
  range of cache blocks (then the tree's keys) through a ring of `stages` shared-memory
  buffers that all consumers read: the cache is read once per program, not once per tile.
  A KV head with more tiles than `consumers` takes several programs (row groups). The
  kernel's tiling when none is given depends on the shapes (`mosaic.default_config`); the
  defaults below are its fallback.

  Attributes:
    block_keys: cache slots per step (64 or 128: the N side of the score wgmma).
    stages: depth of the K/V ring (>= 2, so that a load runs under the previous step).
    consumers: 64-row tiles per program (1 to 3: each holds a [64, head_dim] float32
      accumulator in registers, and three with the producer fill the register file).
    splits: programs along the cache per (batch, KV head, row group); None: as many as
      keep the programs within `target_programs` (at least 1), each with at least 2 blocks
      of a full cache.
    target_programs: what the default split count aims for: one program fills an SM's
      shared memory, so the H100's 132 SMs run one wave of them.
  """

  block_keys: int = 64
  stages: int = 3
  consumers: int = 2
  splits: int | None = None
  target_programs: int = 132

  def __post_init__(self):
    skip = ("splits",) if self.splits is None else ()
    check_int_fields(self, power_of_two=("block_keys",), tiles=("block_keys",), skip=skip)
    kind = type(self).__name__
    if self.block_keys not in (64, 128):
      raise ValueError(f"{kind}.block_keys must be 64 or 128 (the score wgmma's N side), got {self.block_keys}")
    if self.stages < 2:
      raise ValueError(f"{kind}.stages must be >= 2 (a ring that loads under the running step), got {self.stages}")
    if not 1 <= self.consumers <= 3:
      raise ValueError(
        f"{kind}.consumers must be 1, 2 or 3 (64-row tiles per program, each a warpgroup with its "
        f"accumulator in registers), got {self.consumers}"
      )

  @property
  def consumer_registers(self) -> int:
    """Registers per thread of a consumer warpgroup: what the producer leaves, split
    evenly, a multiple of 8 and at most 232 (the ceiling FA3-style kernels use)."""
    share = (_REGISTERS_PER_THREAD_SLOT - PRODUCER_REGISTERS) // self.consumers
    return min(232, share // 8 * 8)

  @classmethod
  def from_string(cls, text: str) -> "TreeAttentionMosaicConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)
