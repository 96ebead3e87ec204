"""Identical Mosaic GPU kernels compiled once per process: a workaround for jax 0.11.2.

jaxlib compiles Mosaic GPU kernels through a process-wide cache keyed by the kernel's
hash, the sha256 of its serialized module (`CachedCompile` in jaxlib's
`mosaic/gpu/custom_call.cc`). The Pallas Mosaic GPU lowering of jax 0.11.2
(`jax/_src/pallas/mosaic_gpu/lowering.py`) calls the private
`jax._src.lib.mosaic_gpu_dialect.get_or_set_dump_options(module)`, which stamps every module
it lowers with a fresh `mosaic_gpu.dump_basename` (a counter that only names dump files).
So identical kernels, such as the same attention kernel in each of a model's 24 layers,
hash differently and ptxas compiles each call site again: minutes for a 24-layer CASTLE
model. No jax issue or option covers it in 0.11.2.

`share_identical_kernels()` wraps that private function so that every module gets the same
basename before jax would stamp it: identical kernels then hash alike and compile once. It
patches a private jax module, so nothing does it at import: the Mosaic ops that have kernels
in every layer (`castle_attention_mosaic`, `castle_forward_mosaic`, `gca_attention_mosaic`,
`gca_forward_mosaic`) call it before they lower anything. It steps aside when Mosaic GPU
dumps are requested (a MOSAIC_GPU_DUMP_* environment variable is set), where the basenames
keep the dump files apart.
"""

from __future__ import annotations

import os

_BASENAME = "mosaic_gpu.dump_basename"
_SHARED_BASENAME = "mosaic_kernel"


def dumps_requested() -> bool:
  """Whether a MOSAIC_GPU_DUMP_* variable asks Mosaic GPU to write dump files."""
  return any(name.startswith("MOSAIC_GPU_DUMP") for name in os.environ)


def share_identical_kernels() -> bool:
  """Makes identical Mosaic GPU kernels hash alike (module docstring); idempotent.

  Returns whether the shared basename is in effect.
  """
  try:
    from jax._src.lib import mosaic_gpu_dialect as dialect
    from jaxlib.mlir import ir
  except ImportError:  # a jaxlib without Mosaic GPU: nothing to share
    return False
  stamp = getattr(dialect, "get_or_set_dump_options", None)
  if stamp is None or dumps_requested():
    return False
  if getattr(stamp, "shares_identical_kernels", False):
    return True

  def get_or_set_dump_options(module):
    attributes = module.operation.attributes
    if _BASENAME not in attributes:
      attributes[_BASENAME] = ir.StringAttr.get(_SHARED_BASENAME, context=module.context)
    return stamp(module)

  get_or_set_dump_options.shares_identical_kernels = True
  dialect.get_or_set_dump_options = get_or_set_dump_options
  return True
