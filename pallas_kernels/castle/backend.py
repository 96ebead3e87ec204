"""Which Pallas kernels run CASTLE training attention: Triton or Mosaic GPU (Hopper).

`choose_backend(config, dtype=..., head_dim=..., window=..., interpret=...)` reads
`CastleKernelConfig.backend`:
  - "triton": the Triton kernels (any CUDA GPU; interpret mode elsewhere);
  - "mosaic": the Mosaic GPU kernels, or a ValueError saying why they cannot run these
    inputs (dtype, head dim, a GPU that is not Hopper, a Triton-only setting) and the fix;
  - "auto": Mosaic on a compute-capability-9.x GPU for the cases in MOSAIC_FASTER_CASES
    (measured faster, forward plus backward), Triton otherwise. Where auto passes over
    Mosaic on a 9.x GPU it logs, once per distinct reason, which backend runs and why
    (INFO on this module's logger); off Hopper Triton is the only choice and goes unlogged.

The choice runs at trace time, from static facts only (dtype, head dim, window, the
first device's compute capability): no length-based switches.
"""

from __future__ import annotations

import logging

import jax.numpy as jnp

from pallas_kernels.castle.config import CastleKernelConfig
from pallas_kernels.castle.mosaic_config import SUPPORTED_HEAD_DIMS
from pallas_kernels.castle.mosaic_ops import SUPPORTED_DTYPES as MOSAIC_DTYPES

# Re-exported: callers and tests read (and fake) them as this module's.
from pallas_kernels.device_facts import LogOnce, announce, compute_capability, not_hopper_reason, pick_kernels

logger = logging.getLogger(__name__)

# Cases where "auto" runs the Mosaic GPU kernels: (head_dim, dtype name, windowed), windowed
# meaning CASTLE-SWL; the cases where they measured faster than the Triton kernels on an
# H100, forward plus backward (benchmarks/RESULTS.md, "CASTLE on Mosaic GPU"). float16 is
# not measured. `mosaic_is_faster` is the only reader.
MOSAIC_FASTER_CASES: frozenset[tuple[int, str, bool]] = frozenset(
  {(128, "bfloat16", True), (64, "bfloat16", True), (64, "bfloat16", False)}
)


def mosaic_is_faster(window: int | None, head_dim: int, dtype) -> bool:
  """Whether the Mosaic kernels measured faster than Triton for this case (on Hopper)."""
  return (head_dim, jnp.dtype(dtype).name, window is not None) in MOSAIC_FASTER_CASES


def mosaic_unsupported_reason(config: CastleKernelConfig, *, dtype, head_dim: int, interpret: bool) -> str | None:
  """None when the Mosaic kernels can run these inputs here, else why not and the fix."""
  if jnp.dtype(dtype) not in MOSAIC_DTYPES:
    return (
      f"the Mosaic GPU kernels take bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}; "
      "cast the inputs or use CastleKernelConfig(backend='triton')"
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return (
      f"the Mosaic GPU kernels take head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim} (last axis of q_u); "
      "use CastleKernelConfig(backend='triton')"
    )
  if interpret:
    return None
  return not_hopper_reason(
    compute_capability(),
    "the Mosaic GPU kernels",
    "use CastleKernelConfig(backend='triton'), or interpret=True for a slow test run",
  )


_log_once = LogOnce(logger)


def choose_backend(config: CastleKernelConfig, *, dtype, head_dim: int, window: int | None, interpret: bool) -> str:
  """ "triton" or "mosaic": the kernels that run these inputs (module docstring).

  Args:
    config: the kernel config; its `backend` is the request.
    dtype, head_dim: the inputs' dtype and (unpadded) head dim.
    window: None for CASTLE, W for CASTLE-SWL.
    interpret: whether the kernels run in interpret mode (then any device can run Mosaic).

  Raises:
    ValueError: backend "mosaic" for inputs or a device the Mosaic kernels cannot take.
  """

  def not_measured_faster():
    if mosaic_is_faster(window, head_dim, dtype):
      return None
    return (
      f"the Mosaic GPU kernels are not measured faster for head_dim {head_dim}, {jnp.dtype(dtype).name}, "
      f"{'CASTLE-SWL' if window is not None else 'CASTLE'} (pallas_kernels.castle.backend.MOSAIC_FASTER_CASES; "
      "benchmarks/RESULTS.md, \"CASTLE on Mosaic GPU\")"
    )

  choice = pick_kernels(
    config.backend,
    lambda: mosaic_unsupported_reason(config, dtype=dtype, head_dim=head_dim, interpret=interpret),
    capability=compute_capability,
    auto_declines=not_measured_faster,
  )
  return announce(choice, op="castle_attention_pallas", config_name="CastleKernelConfig", log_once=_log_once)
