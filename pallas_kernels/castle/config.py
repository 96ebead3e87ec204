"""Tile sizes and launch parameters of the CASTLE Pallas kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields


@dataclasses.dataclass(frozen=True)
class CastleKernelConfig:
  """Block sizes, warps and pipeline stages of the forward and backward kernels.

  Both kernels run one program per (key block, batch * head) and sweep the query
  blocks, so `block_k` rows of the lookahead-key state D (and, in the backward, of
  its gradient and of dK^C, dV^C, dQ^U) stay in registers for the whole sweep.

  Attributes:
    block_q: query rows per step of the forward sweep.
    block_k: key rows per forward program (rows of D held in registers).
    num_warps, num_stages: Triton launch parameters of the forward kernel.
    bwd_block_q, bwd_block_k, bwd_num_warps, bwd_num_stages: the same for the backward.
    split_products: with 16-bit inputs, the float32 intermediates of the lookahead
      branch that set the lookahead scores (the state D, the in-block scores R and
      the lookahead weights W) enter their matrix products as hi + lo 16-bit parts,
      keeping ~16 mantissa bits instead of 8. Their rounding otherwise shifts the
      scores by ~1e-2 and the gradients by a few percent at long lengths; the
      price is more matrix products in both kernels.
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
  split_products: bool = True

  def __post_init__(self):
    if not isinstance(self.split_products, bool):
      raise ValueError(f"CastleKernelConfig.split_products must be a bool, got {self.split_products!r}")
    blocks = ("block_q", "block_k", "bwd_block_q", "bwd_block_k")
    check_int_fields(self, power_of_two=blocks + ("num_warps", "bwd_num_warps"), tiles=blocks,
                     skip=("split_products",))


def default_config(head_dim: int) -> CastleKernelConfig:
  """A heuristic default for a (padded) head dimension."""
  if head_dim > 128:
    return CastleKernelConfig(block_q=32, block_k=32, bwd_block_q=32, bwd_block_k=16)
  return CastleKernelConfig()
