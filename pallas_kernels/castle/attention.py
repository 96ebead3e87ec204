"""`castle_attention_pallas`: CASTLE training attention on the Pallas Triton or Mosaic GPU kernels.

`pallas_kernels.castle.backend.choose_backend` picks the kernels from
`CastleKernelConfig.backend`; this module runs them. It sits apart from `ops` (the
Triton path) because the Mosaic path imports `ops`'s shared helpers.
"""

from __future__ import annotations

import jax

from pallas_kernels.castle.backend import choose_backend
from pallas_kernels.castle.config import CastleKernelConfig
from pallas_kernels.castle.mosaic_attention import castle_attention_mosaic
from pallas_kernels.castle.ops import castle_attention_triton, resolve


def castle_attention_pallas(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  scale: float,
  window: int | None = None,
  config: CastleKernelConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """CASTLE (or CASTLE-SWL with `window`) with the Pallas kernels, differentiable.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, seq, heads, head_dim], one shape and one
      dtype: float32, bfloat16 or float16 for the Triton kernels, bfloat16 or float16
      with head_dim 64 or 128 for the Mosaic ones; shapes already checked by the caller.
    scale: the score scale (the CASTLE op passes 1/sqrt(head_dim)).
    window: None for CASTLE, W >= 1 for CASTLE-SWL (checked by the caller).
    config: backend and tiles; default `default_config(padded head dim)` (backend
      "auto"). The Mosaic kernels run their fixed tiles
      (`CastleKernelConfig.mosaic_config`).
    interpret: run the kernels in Pallas interpret mode; default True on CPU.

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.

  Raises:
    ValueError: a dtype the kernels do not take, or backend "mosaic" for inputs or a
      device the Mosaic kernels cannot take (naming the reason and the fix).
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  config, interpret = resolve(inputs, config, interpret)
  backend = choose_backend(config, dtype=q_u.dtype, head_dim=q_u.shape[-1], window=window, interpret=interpret)
  if backend == "mosaic":
    return castle_attention_mosaic(
      *inputs, scale=scale, window=window, config=config.mosaic_config, interpret=interpret
    )
  return castle_attention_triton(*inputs, scale=scale, window=window, config=config, interpret=interpret)
