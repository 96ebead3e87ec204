"""What the kernels' checks need to know about the device: the first device's CUDA compute
capability and whether it is a Hopper GPU (what the Mosaic GPU kernels need).

Read at trace time (static facts only), so a choice never depends on array values.
"""

from __future__ import annotations

import jax


def compute_capability() -> str | None:
  """The first device's CUDA compute capability ("9.0" on an H100); None off CUDA GPUs."""
  device = jax.devices()[0]
  if device.platform != "gpu":
    return None
  return getattr(device, "compute_capability", None)


def is_hopper(capability: str | None) -> bool:
  """Whether a compute capability is Hopper's (9.x: wgmma, TMA; what Mosaic GPU kernels need)."""
  return capability is not None and capability.split(".")[0] == "9"


def not_hopper_reason(capability: str | None, kernels: str, fix: str) -> str | None:
  """None for a Hopper compute capability, else why `kernels` cannot run on this device,
  followed by `fix`."""
  if is_hopper(capability):
    return None
  device = f"compute capability {capability}" if capability else f"a {jax.devices()[0].platform} device"
  return f"{kernels} need a Hopper GPU (compute capability 9.x), this is {device}; {fix}"
