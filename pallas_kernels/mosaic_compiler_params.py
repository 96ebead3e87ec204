"""The compiler parameters of the Mosaic GPU kernels (CASTLE and GCA)."""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu


def compiler_params(*, warp_local_reductions: bool = False) -> plgpu.CompilerParams:
  """Fast approximate exp, rsqrt and division (`approx_math`).

  Mosaic GPU sets aside 2 KB of shared memory for a kernel with any reduction, in case
  one crosses warps. `warp_local_reductions` (every reduction stays inside a warp, e.g.
  row sums of a WGMMA tile over its columns) gives that back; a reduction that would need
  it then fails to lower.
  """
  extra = dict(reduction_scratch_bytes=0) if warp_local_reductions else {}
  return plgpu.CompilerParams(approx_math=True, **extra)
