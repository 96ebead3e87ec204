"""Tile sizes and schedule of the CASTLE Mosaic GPU (Hopper) kernels."""

from __future__ import annotations

import dataclasses

from pallas_kernels.config_checks import check_int_fields, parse_config

# One warpgroup's wgmma covers 64 rows; a 16-bit operand row of 64 elements is one
# 128-byte swizzle span, the layout TMA writes and wgmma reads fastest.
WGMMA_ROWS = 64
SUPPORTED_HEAD_DIMS = (64, 128)
SCHEDULES = ("warp_specialized", "simple")
# How the warp-specialized forward runs CASTLE-SWL's (key, query) pairs past the window.
PAST_WINDOW_SWEEPS = ("query_major", "key_major")
# Where the backward computes the key side (dK^C, dV^C, dD) of those pairs.
PAST_WINDOW_KEY_GRADS = ("own_kernel", "key_major_sweep")
# Keys per step of the query-major forward past the window (at most a key program).
PAST_WINDOW_STEP_KEYS = (64, 128)
# Key blocks per program of each schedule (one consumer warpgroup per key block).
KEY_BLOCKS_PER_PROGRAM = {"warp_specialized": 2, "simple": 1}


@dataclasses.dataclass(frozen=True)
class CastleMosaicConfig:
  """Tiles and schedule of the key-block-major CASTLE forward on Hopper.

  Each key block's lookahead-key state D ([block_k, head_dim], float32) stays in one
  warpgroup's registers while the program sweeps the query blocks.

  Attributes:
    block_q: query rows per step of the sweep (the N side of the score wgmmas and the
      K side of the lookahead products W R^T and W V^U).
    block_k: key rows per consumer warpgroup (the M side of every score wgmma).
    schedule: "warp_specialized" (default): a producer warpgroup streams the query
      tiles through a two-stage TMA ring to two consumer warpgroups, each owning one
      key block of a 2 * block_k key program, which add one summed output tile per
      step; verified on the H100 and faster than "simple" there (1.2x at 16 x 2K, 1.02x
      at 2 x 16K, 1.4x with a 512 window at 16K). In GPU interpret mode its three
      warpgroups need one thread each (docs/castle_mosaic.md). "simple": one warpgroup
      per key block with synchronous loads, also verified on the H100.
    past_window: CASTLE-SWL only, schedule "warp_specialized" only. Once the queries
      pass a key's window its lookahead key is final, so those pairs are flash
      attention with one more score product. "query_major" (default) runs them in a
      second kernel, query-block major, with the output tile in registers
      (`mosaic_past_window`); "key_major" runs them in the key-major sweep, which
      reduce-adds a [block_q, d] float32 output tile per step.
    past_window_key_grads: CASTLE-SWL backward with past_window="query_major": the key side
      of the pairs past the window (dK^C, dV^C, dD) in a kernel of its own with a producer
      warpgroup streaming the query tiles ("own_kernel", default;
      `mosaic_past_window_backward.key_grads`), the key-major sweep then starting from its
      dD, or inside the synchronous key-major sweep ("key_major_sweep").
    past_window_step_keys: keys per step of the query-major forward past the window
      (`mosaic_past_window`): 128 (default; one key program per step, [64, 128] score
      tiles, half the barrier rounds per key, shared memory full) or 64.
  """

  block_q: int = 64
  block_k: int = 64
  schedule: str = "warp_specialized"
  past_window: str = "query_major"
  past_window_key_grads: str = "own_kernel"
  past_window_step_keys: int = 128

  def __post_init__(self):
    check_int_fields(
      self,
      power_of_two=("block_q", "block_k"),
      tiles=("block_q", "block_k"),
      skip=("schedule", "past_window", "past_window_key_grads"),
    )
    for name in ("block_q", "block_k"):
      if getattr(self, name) != WGMMA_ROWS:
        raise ValueError(
          f"CastleMosaicConfig.{name} must be {WGMMA_ROWS} (one warpgroup's wgmma rows and one "
          f"128-byte swizzle span of 16-bit values), got {getattr(self, name)}"
        )
    if self.schedule not in SCHEDULES:
      raise ValueError(
        f"CastleMosaicConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}; "
        "use schedule='simple' for the one-warpgroup kernel"
      )
    if self.past_window not in PAST_WINDOW_SWEEPS:
      raise ValueError(f"CastleMosaicConfig.past_window must be one of {PAST_WINDOW_SWEEPS}, got {self.past_window!r}")
    if self.past_window_step_keys not in PAST_WINDOW_STEP_KEYS:
      raise ValueError(
        f"CastleMosaicConfig.past_window_step_keys must be one of {PAST_WINDOW_STEP_KEYS}, got "
        f"{self.past_window_step_keys!r}"
      )
    if self.past_window_key_grads not in PAST_WINDOW_KEY_GRADS:
      raise ValueError(
        f"CastleMosaicConfig.past_window_key_grads must be one of {PAST_WINDOW_KEY_GRADS}, got "
        f"{self.past_window_key_grads!r}"
      )

  @property
  def keys_per_program(self) -> int:
    """Key rows per program; sequences are padded to a multiple of this."""
    return KEY_BLOCKS_PER_PROGRAM[self.schedule] * self.block_k

  @property
  def splits_past_window(self) -> bool:
    """Whether a CASTLE-SWL forward runs its past-window pairs in `mosaic_past_window`."""
    return self.schedule == "warp_specialized" and self.past_window == "query_major"

  @property
  def splits_past_window_key_grads(self) -> bool:
    """Whether a CASTLE-SWL backward runs the past-window pairs' key side in its own kernel."""
    return self.splits_past_window and self.past_window_key_grads == "own_kernel"

  @classmethod
  def from_string(cls, text: str) -> "CastleMosaicConfig":
    """From "key=value,..." (`pallas_kernels.config_checks.parse_config`)."""
    return parse_config(cls, text)
