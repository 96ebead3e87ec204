"""Which Pallas kernels run GCA: Triton or Mosaic GPU (Hopper).

`choose_backend(config, dtype=..., head_dim=..., ..., interpret=...)` reads
`GcaKernelConfig.backend`:
  - "triton": the Triton kernels (any CUDA GPU; interpret mode elsewhere);
  - "mosaic": the Mosaic GPU kernels, or a ValueError saying why they cannot run these
    inputs (dtype, head dim, chunk length, ring depth, a GPU that is not Hopper) and the fix;
  - "auto": Mosaic on a compute-capability-9.x GPU where the Mosaic kernels take the inputs
    (measured faster there at the drt_128m shape, forward and backward:
    docs/gca_mosaic.md), Triton otherwise. Where auto passes over Mosaic on a 9.x GPU it
    logs, once per distinct reason, which backend runs and why (INFO on this module's
    logger); off Hopper Triton is the only choice and goes unlogged.

The choice runs at trace time, from static facts only (dtype and sizes, the first device's
compute capability): no length-based switches.
"""

from __future__ import annotations

import logging

from pallas_kernels.device_facts import (
  KernelChoice,
  LogOnce,
  announce,
  compute_capability,
  not_hopper_reason,
  pick_kernels,
)
from pallas_kernels.gca import mosaic_backward_memory, mosaic_backward_queries, mosaic_forward, mosaic_tiles
from pallas_kernels.gca.config import GcaKernelConfig

logger = logging.getLogger(__name__)
_log_once = LogOnce(logger)

# Shared memory one Mosaic program may ask for: an H100 block's 227 KiB, less what the
# lowering adds to the modules' estimates (barriers, alignment, a reduction scratch).
MOSAIC_SHARED_MEMORY = 227 * 1024 - 4096


def mosaic_shared_memory_bytes(*, head_dim: int, top_k: int, dtype, stages: int) -> int:
  """The largest of the three Mosaic kernels' shared-memory estimates."""
  return max(
    mosaic_forward.shared_memory_bytes(head_dim, top_k, dtype, stages),
    mosaic_backward_queries.shared_memory_bytes(head_dim, top_k, dtype, stages),
    mosaic_backward_memory.shared_memory_bytes(head_dim, dtype, stages),
  )


def mosaic_unsupported_reason(
  config: GcaKernelConfig,
  *,
  dtype,
  head_dim: int,
  chunk_len: int,
  query_len: int,
  heads: int,
  kv_heads: int,
  top_k: int,
  interpret: bool,
) -> str | None:
  """None when the Mosaic kernels can run these inputs here, else why not and the fix."""
  query_rows = -(-query_len // mosaic_tiles.TILE_ROWS) * mosaic_tiles.TILE_ROWS
  reason = mosaic_tiles.unsupported_reason(
    head_dim=head_dim,
    chunk_len=chunk_len,
    query_rows=query_rows,
    heads=heads,
    kv_heads=kv_heads,
    dtype=dtype,
    stages=config.mosaic_stages,
  )
  if reason:
    return reason
  needed = mosaic_shared_memory_bytes(head_dim=head_dim, top_k=top_k, dtype=dtype, stages=config.mosaic_stages)
  if needed > MOSAIC_SHARED_MEMORY:
    return (
      f"GcaKernelConfig.mosaic_stages={config.mosaic_stages} asks for about {needed // 1024} KiB of shared "
      f"memory per program at head_dim {head_dim}, over the {MOSAIC_SHARED_MEMORY // 1024} KiB an H100 block "
      "gives; lower mosaic_stages"
    )
  if interpret:
    return None
  return not_hopper_reason(
    compute_capability(),
    "the GCA Mosaic GPU kernels",
    "use GcaKernelConfig(backend='triton'), or interpret=True for a slow test run",
  )


def pick(
  config: GcaKernelConfig,
  *,
  dtype,
  head_dim: int,
  chunk_len: int,
  query_len: int,
  heads: int,
  kv_heads: int,
  top_k: int,
  interpret: bool,
) -> KernelChoice:
  """The kernels `config.backend` runs for these inputs, with the reason where Mosaic cannot
  run or "auto" passes over it (`device_facts.pick_kernels`); arguments as `choose_backend`."""
  return pick_kernels(
    config.backend,
    lambda: mosaic_unsupported_reason(
      config,
      dtype=dtype,
      head_dim=head_dim,
      chunk_len=chunk_len,
      query_len=query_len,
      heads=heads,
      kv_heads=kv_heads,
      top_k=top_k,
      interpret=interpret,
    ),
    capability=compute_capability,
  )


def choose_backend(
  config: GcaKernelConfig,
  *,
  dtype,
  head_dim: int,
  chunk_len: int,
  query_len: int,
  heads: int,
  kv_heads: int,
  top_k: int,
  interpret: bool,
) -> str:
  """ "triton" or "mosaic": the kernels that run these inputs (module docstring).

  Args:
    config: the kernel config; its `backend` is the request.
    dtype, head_dim, chunk_len, query_len, heads, kv_heads, top_k: the inputs' dtype and
      sizes (query_len: rows per query chunk; chunk_len: keys per memory chunk).
    interpret: whether the kernels run in interpret mode (then any device can run Mosaic).

  Raises:
    ValueError: backend "mosaic" for inputs or a device the Mosaic kernels cannot take.
  """
  choice = pick(
    config,
    dtype=dtype,
    head_dim=head_dim,
    chunk_len=chunk_len,
    query_len=query_len,
    heads=heads,
    kv_heads=kv_heads,
    top_k=top_k,
    interpret=interpret,
  )
  return announce(choice, op="gca_attention_pallas", config_name="GcaKernelConfig", log_once=_log_once)
