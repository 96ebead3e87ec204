"""GCA Pallas GPU kernels, Triton and Mosaic GPU (Hopper): fused gather + softmax_1 forward,
deterministic backward. The GCA op (`castle_jax.ops.gca.gca_attention`) picks them by
`implementation`."""

from pallas_kernels.gca.config import GcaMosaicConfig, GcaTritonConfig, default_triton_config
from pallas_kernels.gca.mosaic import gca_attention_mosaic
from pallas_kernels.gca.triton import gca_attention_triton

__all__ = [
  "GcaMosaicConfig",
  "GcaTritonConfig",
  "default_triton_config",
  "gca_attention_mosaic",
  "gca_attention_triton",
]
