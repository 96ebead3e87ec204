"""CASTLE Pallas GPU kernels: key-block-major forward and backward on Pallas Triton (any
CUDA GPU) or Pallas Mosaic GPU (Hopper), chosen by `CastleKernelConfig.backend`."""

from pallas_kernels.castle.attention import castle_attention_pallas
from pallas_kernels.castle.config import CastleDecodeConfig, CastleKernelConfig, default_config
from pallas_kernels.castle.ops import castle_prefill_pallas

__all__ = [
  "CastleDecodeConfig",
  "CastleKernelConfig",
  "castle_attention_pallas",
  "castle_prefill_pallas",
  "default_config",
]
