"""Tile sizes of the CASTLE Mosaic GPU (Hopper) kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields, parse_config

# One warpgroup's wgmma covers 64 rows; a 16-bit operand row of 64 elements is one
# 128-byte swizzle span, the layout TMA writes and wgmma reads fastest.
WGMMA_ROWS = 64
SUPPORTED_HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class CastleMosaicConfig:
  """Tiles of the key-block-major CASTLE forward on Hopper.

  One program per (key block, batch * head) holds its key block's lookahead-key state
  D ([block_k, head_dim], float32) in registers while it sweeps the query blocks.

  Attributes:
    block_q: query rows per step of the sweep (the N side of the score wgmmas and the
      K side of the lookahead products W R^T and W V^U).
    block_k: key rows per program (the M side of every score wgmma: one warpgroup).
  """

  block_q: int = 64
  block_k: int = 64

  def __post_init__(self):
    check_int_fields(self, power_of_two=("block_q", "block_k"), tiles=("block_q", "block_k"))
    for name in ("block_q", "block_k"):
      if getattr(self, name) != WGMMA_ROWS:
        raise ValueError(f"CastleMosaicConfig.{name} must be {WGMMA_ROWS} (one warpgroup's wgmma rows and one "
                         f"128-byte swizzle span of 16-bit values), got {getattr(self, name)}")

  @classmethod
  def from_string(cls, text: str) -> "CastleMosaicConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)
