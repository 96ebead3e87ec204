"""Tile sizes and launch parameters of the CASTLE Pallas Triton kernels (training, prefill
and decoding); the Mosaic GPU kernels' are `mosaic_config.CastleMosaicConfig`."""

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


@dataclasses.dataclass(frozen=True)
class CastleDecodeConfig:
  """Tiling of the one-token decoding kernel (`pallas_kernels.castle.decode`).

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
