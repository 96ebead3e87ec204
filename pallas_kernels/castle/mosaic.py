"""CASTLE attention through the Mosaic GPU (Hopper) kernels, differentiable with a custom VJP.

`castle_attention_mosaic` (`castle_attention(implementation="mosaic")`) and its forward
`castle_forward_mosaic` take the [batch, seq, heads, head_dim] layout of the CASTLE entry
point; `unsupported_reason` says which inputs and devices they cannot take.

The forward folds heads into the batch, zero-pads the sequence to whole programs
(`padded_length`; exact: padded keys come after every real query, padded lookahead values
are zero), computes the in-block scores R and the softmax shift in XLA (`common`, shared
with the Triton path), runs the kernels (`mosaic_forward.forward`, or for CASTLE-SWL
`mosaic_forward_past_window.forward`) and normalizes.

The backward pads the same way, rescales dout by a power of two per (batch, head)
(`cotangent_scale`: the float16 lookahead products need it), computes delta =
rowsum(out * dout) in XLA, runs `mosaic_backward.backward` and folds the in-block scores'
gradient into dQ^C and dV^U. Zero padding is exact in the backward too: padded queries have
zero cotangent and zero scores (so dS vanishes on their rows), padded keys come after every
real query, and padded lookahead values and in-block scores are zero (their lookahead
weights get no gradient). The forward's final D of a padded row is zero, so the lookahead
keys it returns, padded with zeros, are the kernel's starting state.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import device_facts
from pallas_kernels.castle import mosaic_backward, mosaic_forward, mosaic_forward_past_window
from pallas_kernels.castle.common import fold_in_block_grad, in_block_scores, normalize_with_safe_shift
from pallas_kernels.castle.config import SUPPORTED_HEAD_DIMS, CastleMosaicConfig
from pallas_kernels.mosaic_kernel_cache import share_identical_kernels
from pallas_kernels.residuals import keep_for_backward

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
  scores = in_block_scores(q_c, v_u, scale, block_q).reshape(heads, length // block_q, block_q, block_q)
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
    run = functools.partial(
      mosaic_forward_past_window.forward, scale=scale, window=window, config=config, interpret=interpret
    )
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


def unsupported_reason(*, dtype, head_dim: int, interpret: bool) -> str | None:
  """None when the Mosaic kernels can run inputs of `dtype` and `head_dim` here (on a Hopper
  GPU, or anywhere in interpret mode), else why not and the fix."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"the CASTLE Mosaic GPU kernels take bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}; "
      "cast the inputs or use implementation='triton'"
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return (
      f"the CASTLE Mosaic GPU kernels take head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim} (last axis of q_u); "
      "use implementation='triton'"
    )
  if interpret:
    return None
  return device_facts.not_hopper_reason(
    device_facts.compute_capability(), "the CASTLE Mosaic GPU kernels", "use implementation='triton'"
  )


# The forward and the backward are jitted so that a model's layers, which call the op with
# equal shapes, share one traced program each: jax lowers an inner jit's program once per
# module, where it would otherwise lower every call site's Mosaic kernels again (seconds of
# host time per layer; benchmarks/RESULTS.md). The jitted bodies also carry no caller's
# name stack, so their kernels hash alike wherever they appear
# (`pallas_kernels.mosaic_kernel_cache`).
_forward = jax.jit(castle_forward_mosaic, static_argnames=("scale", "window", "config", "interpret"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _castle_mosaic(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret):
  return _forward(q_u, k_u, v_u, q_c, k_c, v_c, scale=scale, window=window, config=config, interpret=interpret).out


def _castle_mosaic_fwd(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret):
  result = _forward(q_u, k_u, v_u, q_c, k_c, v_c, scale=scale, window=window, config=config, interpret=interpret)
  # O(L d) residuals: the inputs, the output, the row log-sum-exp and the final D.
  out, lse, keys = keep_for_backward((result.out, result.lse, result.lookahead_keys))
  return out, (q_u, k_u, v_u, q_c, k_c, v_c, out, lse, keys)


def cotangent_scale(d_out: jax.Array) -> jax.Array:
  """float32 [batch, 1, heads, 1]: per (batch, head), the power of two that brings max |dO|
  into [0.5, 1) (1 where dO is all zero or not finite).

  The backward is linear in dO and its heads are independent, so it runs on dO times this
  scale and divides the gradients by it: exact (powers of two), and it keeps the float16
  lookahead products (dS^U, dD, dW) in float16's normal range. A training loss's cotangents
  are ~1e-6 (a mean over many tokens), which float16 holds only as subnormals with a few
  significant bits: unscaled, the lookahead gradients came out 40-80% off.
  """
  peak = jnp.max(jnp.abs(d_out.astype(jnp.float32)), axis=(1, 3), keepdims=True)
  _, exponent = jnp.frexp(jnp.where(jnp.isfinite(peak), peak, 0.0))
  return jnp.ldexp(jnp.ones_like(peak), -exponent)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _castle_mosaic_bwd(scale, window, config, interpret, residuals, d_out):
  *inputs, out, lse, keys = residuals
  q_u, k_u, v_u, q_c, k_c, v_c = inputs
  batch, seq, heads, _ = q_u.shape
  block_q = config.block_q
  # As the forward pads: the query-major kernel of CASTLE-SWL runs on whole key programs.
  to_heads, from_heads = heads_layout(batch, seq, heads, padded_length(seq, config))
  d_out_scale = cotangent_scale(d_out)
  d_out = d_out.astype(jnp.float32) * d_out_scale
  # delta from the output in the inputs' dtype, as flash attention does.
  delta = jnp.sum(out.astype(jnp.float32) * d_out, axis=-1, keepdims=True)
  lse = lse.transpose(0, 2, 1)[..., None]  # [B, T, H, 1]
  (q_u, k_u, v_u, q_c, k_c, v_c, keys, d_out, lse, delta) = (
    to_heads(x) for x in (*inputs, keys, d_out.astype(q_c.dtype), lse, delta)
  )
  in_block_t = _in_block_scores_transposed(q_c, v_u, scale, block_q)
  dq_u, dk_c, dv_c, dq_c, dk_u, dv_u, d_in_block = mosaic_backward.backward(
    q_u,
    k_u,
    v_u,
    q_c,
    k_c,
    v_c,
    keys,
    d_out,
    lse[..., 0],
    delta[..., 0],
    in_block_t,
    scale=scale,
    window=window,
    config=config,
    interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  dq_c, dv_u = fold_in_block_grad(dq_c, dv_u, d_in_block, q_c, v_u, scale, block_q)
  grads = (dq_u, dk_u, dv_u, dq_c, dk_c, dv_c)
  return tuple((from_heads(g) / d_out_scale).astype(x.dtype) for g, x in zip(grads, inputs))


_castle_mosaic.defvjp(_castle_mosaic_fwd, _castle_mosaic_bwd)


def castle_attention_mosaic(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  scale: float | None = None,
  window: int | None = None,
  config: CastleMosaicConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """CASTLE (or CASTLE-SWL with `window`) with the Mosaic GPU kernels, differentiable.

  Same semantics as `castle_jax.ops.castle.castle_attention(..., window=window)`.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, seq, heads, head_dim], one shape, bfloat16
      or float16, head_dim 64 or 128. The lookahead products (and the lookahead
      gradients) run in float16, so values and cotangents must lie within float16 range.
    scale: the score scale; default 1 / sqrt(head_dim).
    window: None for CASTLE, W >= 1 for CASTLE-SWL.
    config: tile sizes; default `CastleMosaicConfig()`.
    interpret: run in Pallas GPU interpret mode; default True on CPU (slow, for tests).

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.

  Raises:
    ValueError: bad shapes, window, dtype or head dim (naming the argument).
  """
  if q_u.ndim != 4:
    raise ValueError(f"castle_attention_mosaic: q_u must be [batch, seq, heads, head_dim], got shape {q_u.shape}")
  if scale is None:
    scale = q_u.shape[-1] ** -0.5
  if config is None:
    config = CastleMosaicConfig()
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  share_identical_kernels()
  return _castle_mosaic(q_u, k_u, v_u, q_c, k_c, v_c, float(scale), window, config, bool(interpret))
