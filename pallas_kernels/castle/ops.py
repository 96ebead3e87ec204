"""CASTLE attention through the Pallas Triton kernels, differentiable with a custom VJP.

`castle_attention_triton` (`castle_attention(implementation="triton")`) takes the
[batch, seq, heads, head_dim] layout of the CASTLE entry point, folds heads into the batch, zero-pads the sequence to
a multiple of the block sizes and the head dim to a power of two, and runs
`kernels.forward`; the custom VJP runs `kernels.backward`. Padding is exact: padded
keys come after every real query (causal mask), padded lookahead values are zero, and
padded head dims add zero to every dot product.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.castle import kernels
from pallas_kernels.castle.config import CastleTritonConfig, default_triton_config
from pallas_kernels.config_checks import next_power_of_two
from pallas_kernels.residuals import keep_for_backward

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# SiLU(x) >= -0.2785 for every x, so A[t, s] <= S^C[t, s] + 0.2785.
_SILU_MIN = 0.27846454276
# Shifts keep exponents within float32 range: exp(80) ~ 5.5e34 leaves room for sums of
# up to ~6000x that many terms before the float32 maximum.
_EXPONENT_HEADROOM = 80.0


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _in_block_scores(q_c: jax.Array, v_u: jax.Array, scale: float, block_q: int) -> jax.Array:
  """R_ii = Q^C_i V^U_i^T * scale under the causal mask, per query block.

  Args:
    q_c, v_u: [BH, L, D], L a multiple of block_q.

  Returns:
    float32 [BH, L, block_q]; rows of block i hold R_ii.
  """
  heads, length, head_dim = q_c.shape
  blocks = lambda x: x.reshape(heads, length // block_q, block_q, head_dim)
  scores = (
    jnp.einsum(
      "bntd,bnjd->bntj", blocks(q_c), blocks(v_u), preferred_element_type=jnp.float32, precision=_precision(q_c.dtype)
    )
    * scale
  )
  causal = jnp.arange(block_q)[:, None] >= jnp.arange(block_q)[None, :]
  return jnp.where(causal, scores, 0.0).reshape(heads, length, block_q)


def fold_in_block_grad(dq_c, dv_u, d_in_block, q_c, v_u, scale: float, block_q: int):
  """dQ^C and dV^U plus their shares of the in-block scores' gradient.

  R_ii = Q^C_i V^U_i^T * scale under the causal mask (`_in_block_scores`): a backward
  kernel returns dL/dR_ii unmasked and unscaled, and it goes to Q^C and V^U here.

  Args:
    dq_c, dv_u: float32 [BH, L, D], the kernel's gradients without R's share.
    d_in_block: float32 [BH, L, block_q]; rows of query block i hold dL/dR_ii.
    q_c, v_u: [BH, L, D], the inputs.

  Returns:
    (dq_c, dv_u), float32 [BH, L, D].
  """
  heads, length, _ = q_c.shape
  blocks = lambda x: x.reshape(heads, length // block_q, block_q, x.shape[-1])
  causal = jnp.arange(block_q)[:, None] >= jnp.arange(block_q)[None, :]
  d_in_block = jnp.where(causal, blocks(d_in_block), 0.0) * scale
  precision = _precision(jnp.float32)
  dq_c = dq_c + jnp.einsum("bntj,bnjd->bntd", d_in_block, blocks(v_u.astype(jnp.float32)), precision=precision).reshape(
    dq_c.shape
  )
  dv_u = dv_u + jnp.einsum("bntj,bntd->bnjd", d_in_block, blocks(q_c.astype(jnp.float32)), precision=precision).reshape(
    dv_u.shape
  )
  return dq_c, dv_u


def _diagonal_scores(q_c: jax.Array, k_c: jax.Array, scale: float) -> jax.Array:
  """float32 [BH, L]: S^C[t, t], whose term in the softmax sum is exp(0) after the shift."""
  return jnp.sum(q_c.astype(jnp.float32) * k_c.astype(jnp.float32), axis=-1) * scale


def _max_causal_scores(q_c: jax.Array, k_c: jax.Array, scale: float, block: int) -> jax.Array:
  """float32 [BH, L]: max_{s <= t} S^C[t, s], one query block at a time (memory O(L * block))."""
  heads, length, head_dim = q_c.shape
  key_positions = jnp.arange(length)

  def block_max(start):
    q = lax.dynamic_slice_in_dim(q_c, start, block, axis=1)
    scores = (
      jnp.einsum("btd,bsd->bts", q, k_c, preferred_element_type=jnp.float32, precision=_precision(q_c.dtype)) * scale
    )
    visible = (start + jnp.arange(block))[:, None] >= key_positions[None, :]
    return jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1)

  maxima = lax.map(block_max, jnp.arange(0, length, block))  # [L / block, BH, block]
  return maxima.transpose(1, 0, 2).reshape(heads, length)


def normalize_with_safe_shift(run, q_c: jax.Array, k_c: jax.Array, scale: float, block_q: int):
  """A forward kernel's output, normalized, with its per-row shift chosen safely.

  `run(shift=...)` -> (unnormalized output, row sums, final D) of a forward kernel that
  exponentiates scores minus a per-row shift. It runs shifted by each row's diagonal
  score and, only if a sum overflowed, again shifted by the row maximum.

  Returns out (float32 [BH, L, D]), lse (float32 [BH, L]) and the final D.
  """
  diagonal = _diagonal_scores(q_c, k_c, scale)
  acc, sums, keys = run(shift=diagonal)

  def rerun_with_row_max(_):
    # Some score was > ~88 above its row's diagonal score and exp overflowed: shift by
    # the row maximum instead, but never so far that the diagonal term underflows.
    row_max = _max_causal_scores(q_c, k_c, scale, block_q) + _SILU_MIN
    shift = jnp.maximum(diagonal, row_max - _EXPONENT_HEADROOM)
    return run(shift=shift) + (shift,)

  overflowed = jnp.logical_not(jnp.all(jnp.isfinite(sums)))
  acc, sums, keys, shift = lax.cond(overflowed, rerun_with_row_max, lambda _: (acc, sums, keys, diagonal), None)
  return acc / sums[..., None], shift + jnp.log(sums), keys


def _forward(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret):
  """Returns out (float32 [BH, L, D]), lse (float32 [BH, L]) and the final D."""
  in_block = _in_block_scores(q_c, v_u, scale, config.block_q)
  run = functools.partial(
    kernels.forward,
    q_u,
    k_u,
    v_u,
    q_c,
    k_c,
    v_c,
    in_block=in_block,
    scale=scale,
    window=window,
    config=config,
    interpret=interpret,
  )
  return normalize_with_safe_shift(run, q_c, k_c, scale, config.block_q)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _castle_heads(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret):
  """[BH, L, D] inputs -> [BH, L, D] output in the inputs' dtype."""
  out, _, _ = _forward(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret)
  return out.astype(q_c.dtype)


def _castle_heads_fwd(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret):
  out, lse, keys = keep_for_backward(_forward(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret))
  # O(L d) residuals: the inputs, the float32 output, the row log-sum-exp and D.
  return out.astype(q_c.dtype), (q_u, k_u, v_u, q_c, k_c, v_c, out, lse, keys)


def _castle_heads_bwd(scale, window, config, interpret, residuals, d_out):
  q_u, k_u, v_u, q_c, k_c, v_c, out, lse, keys = residuals
  delta = jnp.sum(out * d_out.astype(jnp.float32), axis=-1)
  block_q = config.bwd_block_q
  in_block = _in_block_scores(q_c, v_u, scale, block_q)
  dq_u, dk_c, dv_c, dq_c, dk_u, dv_u, d_in_block = kernels.backward(
    q_u,
    k_u,
    v_u,
    q_c,
    k_c,
    v_c,
    keys,
    d_out.astype(q_c.dtype),
    lse,
    delta,
    in_block,
    scale=scale,
    window=window,
    config=config,
    interpret=interpret,
  )

  dq_c, dv_u = fold_in_block_grad(dq_c, dv_u, d_in_block, q_c, v_u, scale, block_q)
  grads = (dq_u, dk_u, dv_u, dq_c, dk_c, dv_c)
  return tuple(g.astype(x.dtype) for g, x in zip(grads, (q_u, k_u, v_u, q_c, k_c, v_c)))


_castle_heads.defvjp(_castle_heads_fwd, _castle_heads_bwd)


def _prepare(inputs, config: CastleTritonConfig):
  """[B, T, H, D] inputs -> [B * H, L, D'] padded, plus what undoes it."""
  batch, seq, heads, head_dim = inputs[0].shape
  padded_head_dim = max(16, next_power_of_two(head_dim))
  multiple = max(config.block_q, config.block_k, config.bwd_block_q, config.bwd_block_k)
  padded_len = -(-seq // multiple) * multiple

  def to_heads(x):
    x = x.transpose(0, 2, 1, 3).reshape(batch * heads, seq, head_dim)
    return jnp.pad(x, ((0, 0), (0, padded_len - seq), (0, padded_head_dim - head_dim)))

  def from_heads(x):
    x = x[:, :seq, :head_dim].reshape(batch, heads, seq, head_dim)
    return x.transpose(0, 2, 1, 3)

  return tuple(to_heads(x) for x in inputs), from_heads


def unsupported_reason(dtype) -> str | None:
  """Why the Triton kernels cannot take inputs of `dtype` (naming the fix), or None."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"the CASTLE Triton kernels take float32, bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}; "
      "cast the inputs or use implementation='xla'"
    )
  return None


def resolve(inputs, config, interpret):
  """The kernel config and interpret flag; shapes and the window are the caller's to check
  (`castle_jax.ops.castle.castle_attention` validates them), only the dtypes the kernels
  take are checked here."""
  reason = unsupported_reason(inputs[0].dtype)
  if reason:
    raise ValueError(reason)
  if config is None:
    config = default_triton_config(next_power_of_two(inputs[0].shape[-1]))
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  return config, interpret


def castle_prefill_triton(q_u, k_u, v_u, q_c, k_c, v_c, *, scale: float, window=None, config=None, interpret=None):
  """The Triton forward kernel's outputs and the prompt's lookahead keys U^L (Algorithm 5).

  The kernel's final D is the sum over every query block of W_bi V^U_i, i.e. u_s^L for
  each prompt token s, so the UQ-KV cache comes from the same pass as the outputs.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret: see
      `castle_attention_triton`.

  Returns:
    outputs: [batch, seq, heads, head_dim] in the inputs' dtype; lookahead_keys:
    float32 [batch, seq, heads, head_dim], row s is u_s^L.
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  config, interpret = resolve(inputs, config, interpret)
  heads_inputs, from_heads = _prepare(inputs, config)
  out, _, keys = _forward(*heads_inputs, scale, window, config, interpret)
  return from_heads(out).astype(q_c.dtype), from_heads(keys)


def castle_attention_triton(
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  scale: float,
  window: int | None = None,
  config: CastleTritonConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """CASTLE (or CASTLE-SWL with `window`) with the Pallas Triton kernels.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, seq, heads, head_dim], one shape and one
      dtype: float32 (full-precision products), bfloat16 or float16 (products in that
      dtype with float32 accumulation); shapes already checked by the caller.
    scale: the score scale (the CASTLE op passes 1/sqrt(head_dim)).
    window: None for CASTLE, W >= 1 for CASTLE-SWL (checked by the caller).
    config: tile sizes; default `default_triton_config(padded head dim)`.
    interpret: run the kernels in Pallas interpret mode; default True on CPU.

  Returns:
    [batch, seq, heads, head_dim] in the inputs' dtype.

  Raises:
    ValueError: a dtype the kernels do not take.
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  config, interpret = resolve(inputs, config, interpret)
  heads_inputs, from_heads = _prepare(inputs, config)
  out = _castle_heads(*heads_inputs, scale, window, config, interpret)
  return from_heads(out)
