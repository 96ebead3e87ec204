"""Power attention (p = 2) Pallas GPU kernels (Triton backend): fused expand-and-multiply."""

from pallas_kernels.power.config import PowerKernelConfig, default_config
from pallas_kernels.power.ops import power_attention_pallas

__all__ = ["PowerKernelConfig", "default_config", "power_attention_pallas"]
