"""Peak dense bf16 rates for model-FLOPs utilization (MFU)."""

from __future__ import annotations

import jax

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s.
PEAK_BF16_FLOPS = {
  "H100": 989e12,  # SXM
  "H200": 989e12,
  "A100": 312e12,
}


def peak_flops_per_device() -> float | None:
  """The datasheet bf16 peak of the first device, or None if unknown (e.g. CPU)."""
  kind = jax.devices()[0].device_kind
  for name, flops in PEAK_BF16_FLOPS.items():
    if name in kind:
      return flops
  return None
