"""Tile sizes and launch parameters of the CASTLE Pallas kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.castle.mosaic_config import (
  PAST_WINDOW_KEY_GRADS,
  PAST_WINDOW_STEP_KEYS,
  PAST_WINDOW_SWEEPS,
  SCHEDULES,
  CastleMosaicConfig,
)
from pallas_kernels.config_checks import check_int_fields, parse_config

LOOKAHEAD_OPERANDS = ("split", "float16", "input")
# Which kernels run CASTLE training attention (`pallas_kernels.castle.backend` chooses).
BACKENDS = ("auto", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class CastleKernelConfig:
  """Backend, block sizes, warps and pipeline stages of the forward and backward kernels.

  Both kernels run one program per (key block, batch * head) and sweep the query
  blocks, so `block_k` rows of the lookahead-key state D (and, in the backward, of
  its gradient and of dK^C, dV^C, dQ^U) stay in registers for the whole sweep.

  Attributes:
    backend: which kernels `castle_attention_pallas` runs (`pallas_kernels.castle.backend`):
      "triton": the Pallas Triton kernels, any CUDA GPU;
      "mosaic": the Pallas Mosaic GPU kernels (`castle_attention_mosaic`), Hopper
        (compute capability 9.x) only, bfloat16/float16 inputs, head dim 64 or 128;
        other inputs raise a ValueError naming the reason;
      "auto" (default): Mosaic on a 9.x GPU for the cases measured faster there
        (`backend.mosaic_is_faster`), else Triton.
      Prefill (`castle_prefill_pallas`) always runs the Triton forward.
    mosaic_schedule: the Mosaic forward's `CastleMosaicConfig.schedule`
      ("warp_specialized" or "simple"); used only when the Mosaic kernels run.
      It is the one Mosaic setting with a choice (their tiles are fixed at 64 x 64, one
      warpgroup's wgmma), and it needs one: the default warp-specialized forward runs
      three warpgroups, which GPU interpret mode on CPU can run only with one thread
      each, so CPU runs pick "simple". The Triton fields below (block sizes, warps,
      stages, lookahead_operands) do not apply to the Mosaic kernels, whose lookahead
      products always take float16 operands.
    mosaic_past_window: the Mosaic forward's `CastleMosaicConfig.past_window`
      ("query_major" or "key_major"): how CASTLE-SWL's pairs past the window run.
    mosaic_past_window_key_grads: `CastleMosaicConfig.past_window_key_grads`
      ("own_kernel" or "key_major_sweep"): where the backward computes those pairs' dK^C,
      dV^C and dD.
    mosaic_past_window_step_keys: `CastleMosaicConfig.past_window_step_keys` (128 or 64):
      keys per step of the query-major forward past the window.
    block_q: query rows per step of the forward sweep.
    block_k: key rows per forward program (rows of D held in registers).
    num_warps, num_stages: Triton launch parameters of the forward kernel.
    bwd_block_q, bwd_block_k, bwd_num_warps, bwd_num_stages: the same for the backward.
    lookahead_operands: with 16-bit inputs, how the float32 intermediates of the
      lookahead branch that set the lookahead scores (the state D, the in-block
      scores R and the lookahead weights W) enter their matrix products:
      "split": as hi + lo parts in the inputs' dtype (~16 significant bits; one or
        two extra products each);
      "float16": as float16 (11 significant bits, one product; D is scaled by
        2^-8 on the way in, so sums of up to ~16M unit values stay in range);
      "input": rounded to the inputs' dtype (bfloat16: 8 bits; fastest, least
        accurate).
      Rounding in bfloat16 shifts the lookahead scores by ~1e-2 and the gradients
      by a few percent at long lengths (benchmarks/RESULTS.md, "Precision").
      Float32 inputs always use full float32 products.
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
  lookahead_operands: str = "float16"
  backend: str = "auto"
  mosaic_schedule: str = "warp_specialized"
  mosaic_past_window: str = "query_major"
  mosaic_past_window_key_grads: str = "own_kernel"
  mosaic_past_window_step_keys: int = 128

  def __post_init__(self):
    for name, allowed in (
      ("lookahead_operands", LOOKAHEAD_OPERANDS),
      ("backend", BACKENDS),
      ("mosaic_schedule", SCHEDULES),
      ("mosaic_past_window", PAST_WINDOW_SWEEPS),
      ("mosaic_past_window_key_grads", PAST_WINDOW_KEY_GRADS),
      ("mosaic_past_window_step_keys", PAST_WINDOW_STEP_KEYS),
    ):
      if getattr(self, name) not in allowed:
        raise ValueError(f"CastleKernelConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
    blocks = ("block_q", "block_k", "bwd_block_q", "bwd_block_k")
    check_int_fields(
      self,
      power_of_two=blocks + ("num_warps", "bwd_num_warps"),
      tiles=blocks,
      skip=("lookahead_operands", "backend", "mosaic_schedule", "mosaic_past_window", "mosaic_past_window_key_grads"),
    )

  @property
  def mosaic_config(self) -> CastleMosaicConfig:
    """The Mosaic kernels' config: their fixed 64 x 64 tiles, `mosaic_schedule`,
    `mosaic_past_window`, `mosaic_past_window_key_grads` and `mosaic_past_window_step_keys`."""
    return CastleMosaicConfig(
      schedule=self.mosaic_schedule,
      past_window=self.mosaic_past_window,
      past_window_key_grads=self.mosaic_past_window_key_grads,
      past_window_step_keys=self.mosaic_past_window_step_keys,
    )

  @classmethod
  def from_string(cls, text: str) -> "CastleKernelConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)


def default_config(head_dim: int) -> CastleKernelConfig:
  """A heuristic default for a (padded) head dimension (backend "auto")."""
  if head_dim > 128:
    return CastleKernelConfig(block_q=32, block_k=32, bwd_block_q=32, bwd_block_k=16)
  return CastleKernelConfig()


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
