"""CASTLE Pallas GPU kernels: key-block-major forward and backward on Pallas Triton (any
CUDA GPU) and on Pallas Mosaic GPU (Hopper), and a Triton decoding kernel. The CASTLE op
(`castle_jax.ops.castle.castle_attention`) picks them by `implementation`."""

from pallas_kernels.castle.config import CastleDecodeConfig, CastleTritonConfig, default_triton_config
from pallas_kernels.castle.mosaic import castle_attention_mosaic
from pallas_kernels.castle.config import CastleMosaicConfig
from pallas_kernels.castle.mosaic import castle_forward_mosaic
from pallas_kernels.castle.triton import castle_attention_triton, castle_prefill_triton

__all__ = [
  "CastleDecodeConfig",
  "CastleMosaicConfig",
  "CastleTritonConfig",
  "castle_attention_mosaic",
  "castle_attention_triton",
  "castle_forward_mosaic",
  "castle_prefill_triton",
  "default_triton_config",
]
