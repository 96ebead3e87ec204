"""Tile sizes and launch parameters of the GCA Pallas kernels: `GcaTritonConfig` for the
Triton kernels, `GcaMosaicConfig` for the Mosaic GPU (Hopper) ones."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields, is_power_of_two, parse_config
from pallas_kernels.gca.mosaic_tiles import DEFAULT_STAGES


@dataclasses.dataclass(frozen=True)
class GcaTritonConfig:
  """Rows per program, warps and pipeline stages of the three GCA Triton kernels.

  The forward and the query-side backward run one program per (batch, query chunk, head
  block, query block); a program's tile has `block_rows` rows = query rows x heads
  (the query heads that share one kv head are stacked as rows of one product when the
  query chunk is shorter than `block_rows`). The memory-side backward runs one program
  per (batch, memory chunk, kv head).

  Attributes:
    block_rows: rows of the query tile (query rows x heads per program), a power of two >= 16.
    heads_per_program: query heads of one kv head stacked into the tile (a power of two
      dividing heads // kv_heads), or None: as many as fill `block_rows` with the query
      chunk's rows (1 when a query chunk has >= block_rows rows).
    num_warps, num_stages: Triton launch parameters of the forward kernel.
    bwd_num_warps, bwd_num_stages: the same for the query-side backward (dQ, dw).
    memory_num_warps, memory_num_stages: the same for the memory-side backward (dK, dV).

  Pipelining stages multiply the shared memory a kernel asks for (`triton_shared_memory`): the
  default config (None where a config is taken) gets any kernel's stages lowered to 1 for
  the shapes whose tiles would pass the budget; an explicit config runs as given, and one
  over the budget is refused with a ValueError naming the field.
  """

  # Defaults: 64-row tiles with bf16 products fit the registers of 4 warps at head dim 64
  # and memory chunks of up to 64 keys (the DRT shape: 63 keys, 64 query positions).
  block_rows: int = 64
  heads_per_program: int | None = None
  num_warps: int = 4
  num_stages: int = 2
  bwd_num_warps: int = 4
  bwd_num_stages: int = 2
  memory_num_warps: int = 4
  memory_num_stages: int = 2

  def __post_init__(self):
    skip = ("heads_per_program",) if self.heads_per_program is None else ()
    check_int_fields(
      self,
      power_of_two=("block_rows", "num_warps", "bwd_num_warps", "memory_num_warps"),
      tiles=("block_rows",),
      skip=skip,
    )
    if self.heads_per_program is not None and not is_power_of_two(self.heads_per_program):
      raise ValueError(
        f"GcaTritonConfig.heads_per_program must be a power of two or None, got {self.heads_per_program}"
      )

  @classmethod
  def from_string(cls, text: str) -> "GcaTritonConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)


def default_triton_config() -> GcaTritonConfig:
  return GcaTritonConfig()


@dataclasses.dataclass(frozen=True)
class GcaMosaicConfig:
  """The GCA Mosaic GPU kernels' one setting; their tiles are fixed at 64 x 64 (one
  warpgroup's wgmma).

  Attributes:
    stages: depth of the kernels' rings of gathered tiles (2 measured best on an H100 at
      the drt_128m shape; benchmarks/RESULTS.md).
  """

  stages: int = DEFAULT_STAGES

  def __post_init__(self):
    check_int_fields(self, power_of_two=(), tiles=())

  @classmethod
  def from_string(cls, text: str) -> "GcaMosaicConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)
