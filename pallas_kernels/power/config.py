"""Tile sizes and launch parameters of the power-attention Pallas kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields, parse_config

# Features per tile of the kernels' expansion: tspow with d_tile = 16 (the smallest tile
# whose tensor-core products are well shaped). D = C(d / 16 + 1, 2) * 256.
FEATURE_TILE = 16

KERNEL_CHOICES = ("auto", "triton", "mosaic")
# Measured in bf16 only; float16 runs the Triton kernels unless a part asks for "mosaic".
AUTO_MOSAIC_DTYPE = "bfloat16"
# Per part, the head (and value) dims at which "auto" runs the Mosaic GPU kernels on a Hopper GPU:
# where they measured faster than the Triton kernels in the whole op (benchmarks/RESULTS.md, power
# attention). The state gradient's two calls count apart: the queries' and the keys' (which also
# makes phi(K) S).
AUTO_MOSAIC_HEAD_DIMS = {
  "in_chunk_attention": (64, 128),
  "update_state": (64,),
  "query_state": (64,),
  "state_gradient_queries": (),
  "state_gradient_keys": (64,),
}


@dataclasses.dataclass(frozen=True)
class PowerTritonConfig:
  """Block sizes, warps and pipeline stages of the power-attention kernels, and the parts that run
  on Mosaic GPU kernels instead.

  Attributes:
    block_t: tokens per step of the update-state reduction over a chunk.
    block_q: query rows per program of the query-state + attention kernel (and of the
      state-gradient kernel).
    block_k: key rows per step of the intra-chunk attention sweep.
    row_group: rows a of the first tile expanded per step (row_group * 16 expanded
      features per product: 4 gives [.., 64] expanded tiles).
    num_warps, num_stages: Triton launch parameters.
    grad_block: rows per program of the state-gradient kernel (up to 3.5 products' worth of
      tensor work per row block of phi, so more registers per row than the forward).
    grad_num_warps: warps of the state-gradient kernel.
    in_chunk_attention: the kernels of the attention within each chunk, forward and backward:
      "triton"; "mosaic" (Mosaic GPU, `pallas_kernels.power.mosaic_attention`) where those
      apply (a Hopper GPU or interpret mode, bf16/f16, head and value dims 64 or 128), else the
      Triton kernels; or "auto" (the default): Mosaic GPU on a Hopper GPU where they apply and
      measured faster (bf16, head and value dims in `AUTO_MOSAIC_HEAD_DIMS[part]`), else Triton
      (so also Triton in interpret mode).
    update_state: the per-chunk states' kernel, chosen as in_chunk_attention
      (`pallas_kernels.power.mosaic_update_state`).
    query_state: the states' part of the outputs, chosen as in_chunk_attention
      (`pallas_kernels.power.mosaic_query_state`) when the in-chunk attention runs on Mosaic
      GPU (the Triton query kernel computes both parts at once); "mosaic" needs
      in_chunk_attention="mosaic".
    state_gradient: the gradients through the state products, chosen as in_chunk_attention
      (`pallas_kernels.power.mosaic_state_gradient`); "auto" decides for the queries' and the
      keys' call apart.
    mosaic_stages: depth of the Mosaic GPU kernels' rings (the tiles or state blocks loaded
      ahead of the products).
  """

  block_t: int = 64
  block_q: int = 64
  block_k: int = 64
  row_group: int = 4
  num_warps: int = 4
  num_stages: int = 3
  grad_block: int = 64
  grad_num_warps: int = 4
  in_chunk_attention: str = "auto"
  update_state: str = "auto"
  query_state: str = "auto"
  state_gradient: str = "auto"
  mosaic_stages: int = 2

  def __post_init__(self):
    choices = ("in_chunk_attention", "update_state", "query_state", "state_gradient")
    not_sizes = ("num_stages", "mosaic_stages", *choices)
    check_int_fields(
      self,
      power_of_two=tuple(f.name for f in dataclasses.fields(self) if f.name not in not_sizes),
      tiles=("block_t", "block_q", "block_k", "grad_block"),
      skip=choices,
    )
    for name in choices:
      if getattr(self, name) not in KERNEL_CHOICES:
        raise ValueError(f"PowerTritonConfig.{name} must be one of {KERNEL_CHOICES}, got {getattr(self, name)!r}")
    if self.query_state == "mosaic" and self.in_chunk_attention != "mosaic":
      raise ValueError(
        "PowerTritonConfig(query_state='mosaic') needs in_chunk_attention='mosaic' (the Triton query kernel "
        "computes the states' part and the attention together); set both"
      )
    if self.row_group > FEATURE_TILE:
      raise ValueError(f"PowerTritonConfig.row_group must be <= {FEATURE_TILE}, got {self.row_group}")
    if self.block_q % self.block_k and self.block_k % self.block_q:
      raise ValueError(
        f"PowerTritonConfig.block_q ({self.block_q}) and block_k ({self.block_k}) must divide one another"
      )

  @property
  def chunk_multiple(self) -> int:
    """Every chunk size must be a multiple of this (all blocks tile a chunk exactly)."""
    return max(self.block_t, self.block_q, self.block_k, self.grad_block)

  @classmethod
  def from_string(cls, text: str) -> "PowerTritonConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)


def default_triton_config() -> PowerTritonConfig:
  return PowerTritonConfig()
