"""CASTLE attention: the one public entry point.

`implementation`:
  - "reference": the naive parallel form of Theorem 1 (O(L^3), plain jnp); a test
    oracle for tiny sequences.
  - "xla": the blockwise Algorithms 1/3 (O(L^2 d) time, O(L d) memory) in XLA.
  - "triton": the Pallas Triton kernels of `pallas_kernels.castle` (key-block-major
    forward and backward, O(L d) memory), any CUDA GPU; `kernel_config` a
    `CastleTritonConfig`.
  - "mosaic": the Pallas Mosaic GPU kernels (Hopper only, bfloat16/float16, head dim 64
    or 128; other inputs raise); `kernel_config` a `CastleMosaicConfig`.
  The kernels compile on a CUDA GPU and run in Pallas interpret mode elsewhere (slow;
  for tests).
  - None: the fastest that can run here (`castle_jax.ops.backend.choose`, logged): on a
    Hopper GPU "mosaic" for the cases where it measured faster than "triton"
    (`MOSAIC_FASTER_CASES`), else "triton" on a GPU for float32/bfloat16/float16 inputs,
    else "xla". Prefill and decoding (`castle_jax.ops.castle.decode`) take the same names.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from castle_jax.ops.backend import Implementation, choose, rejects_renamed_arguments
from castle_jax.ops.castle.xla import DEFAULT_BLOCK_SIZE, castle_blockwise
from castle_jax.ops.castle.common import validate_block_size, validate_inputs
from castle_jax.ops.castle.reference import castle_parallel
from castle_jax.ops.numerics import score_scale
from castle_jax.sharding import SEQUENCE_HEADS_AXES, map_over_shards
from pallas_kernels.castle import (
  CastleMosaicConfig,
  CastleTritonConfig,
  castle_attention_mosaic,
  castle_attention_triton,
)
from pallas_kernels.castle import mosaic, triton as triton_ops

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic")
DEFAULT_ORDER = ("mosaic", "triton", "xla")
# The kernel config type of each kernel implementation (`kernel_config=`).
KERNEL_CONFIGS = {"triton": CastleTritonConfig, "mosaic": CastleMosaicConfig}

# Cases where the default takes "mosaic" on a Hopper GPU: (head_dim, dtype name, windowed),
# windowed meaning CASTLE-SWL; the cases where the Mosaic kernels measured faster than the
# Triton ones on an H100, forward plus backward (benchmarks/RESULTS.md, "CASTLE on Mosaic
# GPU"). float16 is not measured.
MOSAIC_FASTER_CASES: frozenset[tuple[int, str, bool]] = frozenset(
  {(128, "bfloat16", True), (64, "bfloat16", True), (64, "bfloat16", False)}
)


def _interpret() -> bool:
  return jax.default_backend() == "cpu"


def mosaic_not_measured_faster(dtype, head_dim: int, window: int | None) -> str | None:
  """None where the Mosaic kernels measured faster than the Triton ones, else why the
  default does not take them."""
  if (head_dim, jnp.dtype(dtype).name, window is not None) in MOSAIC_FASTER_CASES:
    return None
  return (
    f"not measured faster than 'triton' for head_dim {head_dim}, {jnp.dtype(dtype).name}, "
    f"{'CASTLE-SWL' if window is not None else 'CASTLE'} (castle_jax.ops.castle.api.MOSAIC_FASTER_CASES)"
  )


def implementations(
  dtype, head_dim: int, window: int | None, triton_reason: Callable[[], str | None] | None = None
) -> dict[str, Implementation]:
  """The CASTLE implementations for inputs of `dtype` and `head_dim` (training and prefill).

  Args:
    dtype, head_dim: the inputs' dtype and head dim.
    window: None for CASTLE, W for CASTLE-SWL.
    triton_reason: a further check of the Triton kernels.
  """

  def triton_unsupported() -> str | None:
    return triton_ops.unsupported_reason(dtype) or (triton_reason() if triton_reason else None)

  return {
    "reference": Implementation(),
    "xla": Implementation(),
    "triton": Implementation(triton_unsupported, default_backends=("gpu",), config_type=CastleTritonConfig),
    "mosaic": Implementation(
      lambda: mosaic.unsupported_reason(dtype=dtype, head_dim=head_dim, interpret=_interpret()),
      default_backends=("gpu",),
      config_type=CastleMosaicConfig,
      default_declines=lambda: mosaic_not_measured_faster(dtype, head_dim, window),
    ),
  }


@rejects_renamed_arguments
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
  kernel_config: CastleTritonConfig | CastleMosaicConfig | None = None,
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
    kernel_config: the kernels' config: a `CastleTritonConfig` for "triton", a
      `CastleMosaicConfig` for "mosaic", or None for their defaults. With
      implementation=None only the implementation it configures (or "xla") can be chosen.

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.

  Raises:
    ValueError: bad shapes/dtypes (naming the argument), window <= 0, bad block_size,
      unknown implementation, an explicit one that cannot run, or a kernel_config of
      another implementation's type.
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  validate_inputs(inputs, window)
  validate_block_size(block_size)
  table = implementations(q_u.dtype, q_u.shape[-1], window)
  implementation = choose("castle_attention", implementation, table, DEFAULT_ORDER, kernel_config=kernel_config)
  if implementation in KERNEL_CONFIGS:
    kernels = castle_attention_triton if implementation == "triton" else castle_attention_mosaic
    run = functools.partial(
      kernels, scale=score_scale(q_u.shape[-1]), window=window, config=kernel_config, interpret=_interpret()
    )
    return map_over_shards(run, inputs, [SEQUENCE_HEADS_AXES] * 6, SEQUENCE_HEADS_AXES, what="castle_attention")
  if implementation == "reference":
    return castle_parallel(*inputs, window=window)
  return castle_blockwise(*inputs, window=window, block_size=block_size)
