"""CASTLE forward through the Mosaic GPU kernel, in the [batch, seq, heads, head_dim] layout.

`castle_forward_mosaic` folds heads into the batch, zero-pads the sequence to whole
programs (`padded_length`; exact: padded keys come after every real query, padded
lookahead values are zero), precomputes the in-block scores R and the softmax shift in
XLA, runs the kernels (`mosaic_forward.forward`, or for CASTLE-SWL
`mosaic_past_window.forward`) and normalizes. `mosaic_attention.castle_attention_mosaic`
makes it differentiable.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.castle import mosaic_forward, mosaic_past_window
from pallas_kernels.castle.mosaic_config import SUPPORTED_HEAD_DIMS, CastleMosaicConfig
from pallas_kernels.mosaic_kernel_cache import share_identical_kernels

# The shift rule and the XLA-side tiles are the Triton path's, shared rather than repeated.
from pallas_kernels.castle.ops import _in_block_scores, normalize_with_safe_shift

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)


class MosaicForward(NamedTuple):
  """What the forward returns; `lse` and `lookahead_keys` are the backward's residuals.

  out: [batch, seq, heads, head_dim] in the inputs' dtype.
  lse: float32 [batch, heads, seq], the row log-sum-exp of the scores A.
  lookahead_keys: float32 [batch, seq, heads, head_dim], row s is u_s^L (the final D).
  """

  out: jax.Array
  lse: jax.Array
  lookahead_keys: jax.Array


_INPUT_NAMES = ("q_u", "k_u", "v_u", "q_c", "k_c", "v_c")


def _check(inputs, window):
  """The kernel's own limits; the full checks of shapes and windows are `castle_attention`'s
  (kernels import nothing of castle_jax), so only what would otherwise fail obscurely here."""
  for name, x in zip(_INPUT_NAMES, inputs):
    if x.ndim != 4 or x.shape != inputs[0].shape or x.dtype != inputs[0].dtype:
      raise ValueError(
        f"castle_forward_mosaic: {name} must have q_u's shape [batch, seq, heads, head_dim] "
        f"{inputs[0].shape} and dtype {inputs[0].dtype}; got {x.shape} {x.dtype}"
      )
  if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
    raise ValueError(f"castle_forward_mosaic: window must be None or an int >= 1, got {window!r}")
  dtype, head_dim = inputs[0].dtype, inputs[0].shape[-1]
  if dtype not in SUPPORTED_DTYPES:
    raise ValueError(
      f"castle_forward_mosaic takes bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}; "
      "cast the inputs or use the Triton kernels (implementation='triton')"
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise ValueError(
      f"castle_forward_mosaic takes head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim} "
      "(last axis of q_u); use the Triton kernels for other head dims"
    )


def _in_block_scores_transposed(q_c, v_u, scale, block_q):
  """float32 [BH, L, block_q]; rows of query block i hold R_ii^T (keys j down, queries t across)."""
  heads, length, _ = q_c.shape
  scores = _in_block_scores(q_c, v_u, scale, block_q).reshape(heads, length // block_q, block_q, block_q)
  return scores.swapaxes(-1, -2).reshape(heads, length, block_q)


def padded_length(seq: int, config: CastleMosaicConfig) -> int:
  """The sequence length the kernels run on: `seq` zero-padded to whole query blocks and
  key programs (the query-major kernel's programs of CASTLE-SWL are as long as those)."""
  multiple = max(config.block_q, config.keys_per_program)
  return -(-seq // multiple) * multiple


def heads_layout(batch: int, seq: int, heads: int, padded: int):
  """(to_heads, from_heads): [B, T, H, X] <-> [B * H, padded, X] (zero-padded sequence)."""

  def to_heads(x):
    x = x.transpose(0, 2, 1, 3).reshape(batch * heads, seq, x.shape[-1])
    return jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0)))

  def from_heads(x):
    return x[:, :seq].reshape(batch, heads, seq, x.shape[-1]).transpose(0, 2, 1, 3)

  return to_heads, from_heads


def _forward_heads(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret):
  """[BH, L, d] -> out float32 [BH, L, d], lse float32 [BH, L], keys float32 [BH, L, d]."""
  in_block_t = _in_block_scores_transposed(q_c, v_u, scale, config.block_q)
  if window is None:
    run = functools.partial(mosaic_forward.forward, scale=scale, config=config, interpret=interpret)
  else:
    run = functools.partial(mosaic_past_window.forward, scale=scale, window=window, config=config, interpret=interpret)
  run = functools.partial(run, q_u, k_u, v_u, q_c, k_c, v_c, in_block_t)
  return normalize_with_safe_shift(run, q_c, k_c, scale, config.block_q)


def castle_forward_mosaic(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  scale: float,
  window: int | None = None,
  config: CastleMosaicConfig | None = None,
  interpret: bool = False,
) -> MosaicForward:
  """CASTLE (or CASTLE-SWL with `window`) forward with the Mosaic GPU kernel (Hopper).

  Same semantics as `castle_jax.ops.castle.castle_attention(..., window=window)` with
  `scale` as the score scale (the op uses 1/sqrt(head_dim)).

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, seq, heads, head_dim], one shape, bfloat16
      or float16, head_dim 64 or 128. The lookahead products run in float16
      (module docstring of `mosaic_forward`), so values must lie within float16 range.
    scale: the score scale.
    window: None for CASTLE, W >= 1 for CASTLE-SWL.
    config: tile sizes; default `CastleMosaicConfig()`.
    interpret: run in Pallas GPU interpret mode (CPU; slow, for tests).

  Returns:
    MosaicForward(out, lse, lookahead_keys).

  Raises:
    ValueError: bad shapes, window, dtype or head dim (naming the argument).
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  _check(inputs, window)
  config = CastleMosaicConfig() if config is None else config
  share_identical_kernels()
  batch, seq, heads, _ = q_u.shape
  padded = padded_length(seq, config)

  to_heads, from_heads = heads_layout(batch, seq, heads, padded)
  out, lse, keys = _forward_heads(
    *(to_heads(x) for x in inputs), scale, window, config, plgpu.InterpretGPUParams() if interpret else None
  )
  return MosaicForward(
    out=from_heads(out).astype(q_c.dtype), lse=lse[:, :seq].reshape(batch, heads, seq), lookahead_keys=from_heads(keys)
  )
