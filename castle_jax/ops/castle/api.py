"""CASTLE attention: the one public entry point.

`implementation`:
  - "reference": the naive parallel form of Theorem 1 (O(L^3), plain jnp); a test
    oracle for tiny sequences.
  - "xla": the blockwise Algorithms 1/3 (O(L^2 d) time, O(L d) memory) in XLA.
  - "pallas": the Pallas kernels of `pallas_kernels.castle` (key-block-major forward
    and backward, O(L d) memory); compiled on a CUDA GPU, run in Pallas interpret mode
    elsewhere (slow; for tests). `pallas_config.backend` picks the kernels
    (`pallas_kernels.castle.backend`): "triton" (any GPU), "mosaic" (Mosaic GPU,
    Hopper only, bf16/f16, head dim 64/128; other inputs raise) or "auto" (default:
    Mosaic on a compute-capability-9.x GPU where it was measured faster, else Triton).
  - None: "pallas" on a GPU for float32/bfloat16/float16 inputs, else "xla"
    (`castle_jax.ops.backend.choose`: logged at debug level; an explicit choice that
    cannot run raises). Prefill and decoding (`castle_jax.ops.castle.decode`) choose the
    same way, from `implementations`.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from castle_jax.ops.backend import Implementation, choose
from castle_jax.ops.castle.blockwise import DEFAULT_BLOCK_SIZE, castle_blockwise
from castle_jax.ops.castle.common import validate_block_size, validate_inputs
from castle_jax.ops.castle.reference import castle_parallel
from castle_jax.ops.numerics import score_scale
from castle_jax.sharding import SEQUENCE_HEADS_AXES, map_over_shards
from pallas_kernels.castle import castle_attention_pallas
from pallas_kernels.castle.ops import SUPPORTED_DTYPES

IMPLEMENTATIONS = ("reference", "xla", "pallas")
DEFAULT_ORDER = ("pallas", "xla")


def _kernel_dtype_reason(dtype) -> str | None:
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"the CASTLE Pallas kernels take float32, bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}; "
      "cast the inputs or use implementation='xla'"
    )
  return None


def implementations(dtype, pallas_reason: Callable[[], str | None] | None = None) -> dict[str, Implementation]:
  """The CASTLE implementations for inputs of `dtype` (training, prefill and decoding).

  Args:
    dtype: the inputs' dtype.
    pallas_reason: a further check of the Pallas path (the decoding kernel's head dims).
  """

  def pallas_unsupported() -> str | None:
    return _kernel_dtype_reason(dtype) or (pallas_reason() if pallas_reason else None)

  return {
    "reference": Implementation(),
    "xla": Implementation(),
    "pallas": Implementation(pallas_unsupported, default_backends=("gpu",)),
  }


def castle_attention(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  window: int | None = None,
  implementation: str | None = None,
  block_size: int = DEFAULT_BLOCK_SIZE,
  pallas_config=None,
) -> jax.Array:
  """Causal attention with lookahead keys (CASTLE), or CASTLE-SWL with `window`.

  Per head, token t attends to tokens s <= t with weights
  softmax_s(q^C_t . k^C_s / sqrt(d) - SiLU(q^C_t . u_s^t / sqrt(d))), where the lookahead
  key u_s^t = sum_{s < j <= t} sigmoid(q^U_s . k^U_j / sqrt(d)) v^U_j (j <= s + W under
  SWL), and returns the weighted sum of v^C_s.

  Args:
    q_u, k_u, v_u: [batch, seq, heads, head_dim] lookahead queries, keys, values.
    q_c, k_c, v_c: [batch, seq, heads, head_dim] causal queries, keys, values.
      All six share one shape and dtype; bf16/f16 are computed in float32 (with jax's
      default matmul precision: TF32 on recent GPUs unless raised with
      `jax.default_matmul_precision`).
    window: None for CASTLE; W >= 1 for CASTLE-SWL, where u_s sees tokens s+1 .. s+W.
    implementation: one of IMPLEMENTATIONS or None (see module docstring).
    block_size: tokens per block for "xla" (static).
    pallas_config: a `pallas_kernels.castle.CastleKernelConfig` for "pallas" (its
      `backend`: "auto", "triton" or "mosaic"); None picks a heuristic default with
      backend "auto".

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.

  Raises:
    ValueError: bad shapes/dtypes (naming the argument), window <= 0, bad block_size,
      unknown implementation or an explicit one that cannot run.
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  validate_inputs(inputs, window)
  validate_block_size(block_size)
  implementation = choose("castle_attention", implementation, implementations(q_u.dtype), DEFAULT_ORDER)
  if implementation == "pallas":
    run = functools.partial(
      castle_attention_pallas, scale=score_scale(q_u.shape[-1]), window=window, config=pallas_config
    )
    return map_over_shards(run, inputs, [SEQUENCE_HEADS_AXES] * 6, SEQUENCE_HEADS_AXES, what="castle_attention")
  if implementation == "reference":
    return castle_parallel(*inputs, window=window)
  return castle_blockwise(*inputs, window=window, block_size=block_size)
