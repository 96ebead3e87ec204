"""CASTLE Pallas GPU kernels (Triton backend): key-block-major forward and backward."""

from pallas_kernels.castle.config import CastleDecodeConfig, CastleKernelConfig, default_config
from pallas_kernels.castle.ops import castle_attention_pallas, castle_prefill_pallas

__all__ = ["CastleDecodeConfig", "CastleKernelConfig", "castle_attention_pallas", "castle_prefill_pallas", "default_config"]
