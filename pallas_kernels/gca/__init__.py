"""GCA Pallas GPU kernels (Triton, and Mosaic GPU on Hopper): fused gather + softmax_1 forward,
deterministic backward."""

from pallas_kernels.gca.config import GcaKernelConfig, default_config
from pallas_kernels.gca.ops import gca_attention_pallas

__all__ = ["GcaKernelConfig", "default_config", "gca_attention_pallas"]
