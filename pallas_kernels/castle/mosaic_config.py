"""Tile sizes of the CASTLE Mosaic GPU (Hopper) kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields, parse_config

# One warpgroup's wgmma covers 64 rows; a 16-bit operand row of 64 elements is one
# 128-byte swizzle span, the layout TMA writes and wgmma reads fastest.
WGMMA_ROWS = 64
SUPPORTED_HEAD_DIMS = (64, 128)
# Key blocks per program of the key-major forward (one consumer warpgroup each).
KEY_BLOCKS_PER_PROGRAM = 2


@dataclasses.dataclass(frozen=True)
class CastleMosaicConfig:
  """Tiles of the key-block-major CASTLE kernels on Hopper.

  Each key block's lookahead-key state D ([block_k, head_dim], float32) stays in one
  warpgroup's registers while the program sweeps the query blocks. The forward runs a
  producer warpgroup that streams the query tiles through a two-stage TMA ring to two
  consumer warpgroups, each owning one key block of a 2 * block_k key program.
  CASTLE-SWL's pairs past the window run in kernels of their own, query-block major
  (`mosaic_past_window`, `mosaic_past_window_backward`). docs/castle_mosaic.md describes
  the kernels; benchmarks/RESULTS.md has the measurements that chose this schedule.

  Attributes:
    block_q: query rows per step of the sweep (the N side of the score wgmmas and the
      K side of the lookahead products W R^T and W V^U).
    block_k: key rows per consumer warpgroup (the M side of every score wgmma).
  """

  block_q: int = WGMMA_ROWS
  block_k: int = WGMMA_ROWS

  def __post_init__(self):
    check_int_fields(self, power_of_two=("block_q", "block_k"), tiles=("block_q", "block_k"))
    for name in ("block_q", "block_k"):
      if getattr(self, name) != WGMMA_ROWS:
        raise ValueError(
          f"CastleMosaicConfig.{name} must be {WGMMA_ROWS} (one warpgroup's wgmma rows and one "
          f"128-byte swizzle span of 16-bit values), got {getattr(self, name)}"
        )

  @property
  def keys_per_program(self) -> int:
    """Key rows per program of the forward; sequences are padded to a multiple of this."""
    return KEY_BLOCKS_PER_PROGRAM * self.block_k

  @classmethod
  def from_string(cls, text: str) -> "CastleMosaicConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)
