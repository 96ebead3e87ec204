"""Tile sizes and launch parameters of the CASTLE Pallas kernels, one config type per
implementation: `CastleTritonConfig` (training and prefill on Triton), `CastleMosaicConfig`
(the Mosaic GPU kernels) and `CastleDecodeConfig` (the Triton decoding kernel)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields, parse_config


@dataclasses.dataclass(frozen=True)
class CastleTritonConfig:
  """Block sizes, warps and pipeline stages of the Triton forward and backward kernels
  (`castle_attention_triton`, and the prefill's forward).

  Both kernels run one program per (key block, batch * head) and sweep the query
  blocks, so `block_k` rows of the lookahead-key state D (and, in the backward, of
  its gradient and of dK^C, dV^C, dQ^U) stay in registers for the whole sweep.

  With 16-bit inputs the float32 intermediates of the lookahead branch that set the
  lookahead scores (the state D, the in-block scores R and the lookahead weights W) enter
  their matrix products as float16 (11 significant bits, one product; D is scaled by 2^-8
  on the way in, so sums of up to ~16M unit values stay in range); float32 inputs take
  full float32 products. benchmarks/RESULTS.md ("Precision") has the errors this gives.

  Attributes:
    block_q: query rows per step of the forward sweep.
    block_k: key rows per forward program (rows of D held in registers).
    num_warps, num_stages: Triton launch parameters of the forward kernel.
    bwd_block_q, bwd_block_k, bwd_num_warps, bwd_num_stages: the same for the backward.
  """

  # Defaults: the fastest of the configurations measured on an H100 at d = 128
  # (benchmarks/RESULTS.md).
  block_q: int = 32
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2
  bwd_block_q: int = 32
  bwd_block_k: int = 32
  bwd_num_warps: int = 4
  bwd_num_stages: int = 1

  def __post_init__(self):
    blocks = ("block_q", "block_k", "bwd_block_q", "bwd_block_k")
    check_int_fields(self, power_of_two=blocks + ("num_warps", "bwd_num_warps"), tiles=blocks)

  @classmethod
  def from_string(cls, text: str) -> "CastleTritonConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)


def default_triton_config(head_dim: int) -> CastleTritonConfig:
  """A heuristic default for a (padded) head dimension."""
  if head_dim > 128:
    return CastleTritonConfig(block_q=32, block_k=32, bwd_block_q=32, bwd_block_k=16)
  return CastleTritonConfig()


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
  (`mosaic_forward_past_window`, `mosaic_backward_past_window`). docs/castle_mosaic.md describes
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


@dataclasses.dataclass(frozen=True)
class CastleDecodeConfig:
  """Tiling of the one-token decoding kernel (`pallas_kernels.castle.triton_decode`).

  One program per (split, batch, head) sweeps its share of the cached rows in blocks
  of `block_rows`; the `splits` partial softmax states of a head are merged afterwards
  (split-K decoding), so batch * heads * splits programs keep the GPU busy when
  batch * heads alone would not fill it.

  Attributes:
    block_rows: cached rows per step (a power of two >= 16).
    splits: programs per (batch, head); None: enough for ~4096 programs in all.
    num_warps, num_stages: Triton launch parameters.
  """

  # Defaults: the fastest measured on an H100 (batch 64, 16K cached tokens, 9 heads x 128).
  block_rows: int = 32
  splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_int_fields(
      self,
      power_of_two=("block_rows", "num_warps"),
      tiles=("block_rows",),
      skip=("splits",) if self.splits is None else (),
    )

  @classmethod
  def from_string(cls, text: str) -> "CastleDecodeConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)
