"""Power attention (p = 2) Pallas kernels: fused expand-and-multiply on Pallas Triton, and Mosaic GPU
kernels for each part but the discumsums on Hopper, chosen per part by `PowerTritonConfig`. The
power-attention op (`castle_jax.ops.power.power_attention`) runs them for implementation="triton"."""

from pallas_kernels.power.config import PowerTritonConfig, default_triton_config
from pallas_kernels.power.triton import power_attention_triton

__all__ = ["PowerTritonConfig", "default_triton_config", "power_attention_triton"]
