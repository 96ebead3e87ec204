"""What the Pallas backend choices need to know about the device, and how they say what
they chose: the first device's CUDA compute capability, whether it is a Hopper GPU, a
log that says each distinct message once, and the choice between Triton and Mosaic GPU
kernels that CASTLE and GCA share (`pick_kernels`, `announce`).

Read at trace time (static facts only), so a choice never depends on array values.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple

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


class LogOnce:
  """Logs each distinct message once, at INFO on `logger` (a backend choice made at every
  trace would otherwise repeat itself). `cache_clear()` forgets the messages seen."""

  def __init__(self, logger: logging.Logger):
    self.logger = logger
    self._seen: set[str] = set()

  def __call__(self, message: str) -> None:
    if message not in self._seen:
      self._seen.add(message)
      self.logger.info(message)

  def cache_clear(self) -> None:
    self._seen.clear()


class KernelChoice(NamedTuple):
  """The kernels a `backend` request runs ("triton" or "mosaic"); `reason`: why the Mosaic
  kernels cannot run (a "mosaic" request) or why "auto" passed over them on a Hopper GPU,
  else None; `capability`: the compute capability read for "auto" (None otherwise)."""

  kernels: str
  reason: str | None = None
  capability: str | None = None


def pick_kernels(
  requested: str,
  mosaic_reason: Callable[[], str | None],
  *,
  capability: Callable[[], str | None],
  auto_declines: Callable[[], str | None] = lambda: None,
) -> KernelChoice:
  """The kernels for a config's `backend`: "triton"; "mosaic" (with the reason if they cannot
  run); "auto": Mosaic on a Hopper GPU where they can run and `auto_declines()` gives no
  reason against them (e.g. not measured faster), else Triton.

  The callables are read only when the request needs them: `mosaic_reason` (why the Mosaic
  kernels cannot run these inputs here), `capability` (the device's compute capability; a
  backend module passes its own name, which tests fake).
  """
  if requested == "triton":
    return KernelChoice("triton")
  reason = mosaic_reason()
  if requested == "mosaic":
    return KernelChoice("mosaic", reason)
  device = capability()
  if not is_hopper(device):
    return KernelChoice("triton", capability=device)
  reason = reason or auto_declines()
  return KernelChoice("mosaic" if reason is None else "triton", reason, device)


def announce(choice: KernelChoice, *, op: str, config_name: str, log_once: LogOnce) -> str:
  """`choice.kernels`, after raising for a "mosaic" request that cannot run and logging (once
  per message) why "auto" runs Triton on a Hopper GPU.

  Raises:
    ValueError: backend "mosaic" for inputs or a device the Mosaic kernels cannot take.
  """
  if choice.reason is not None:
    if choice.kernels == "mosaic":
      raise ValueError(f"{op}: {config_name}.backend='mosaic' cannot run: {choice.reason}")
    log_once(
      f"{op}: backend='auto' runs the Triton kernels on this compute capability {choice.capability} GPU: "
      f"{choice.reason}"
    )
  return choice.kernels
