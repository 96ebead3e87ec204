"""Tiling of the hybrid tree attention kernel (`pallas_kernels.tree_attention.triton`)."""

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
