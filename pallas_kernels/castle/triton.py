"""CASTLE attention through the Pallas Triton kernels, differentiable with a custom VJP.

`castle_attention_triton` (`castle_attention(implementation="triton")`) takes the
[batch, seq, heads, head_dim] layout of the CASTLE entry point, folds heads into the batch,
zero-pads the sequence to a multiple of the block sizes and the head dim to a power of two,
and runs `triton_kernels.forward`; the custom VJP runs `triton_kernels.backward`. Padding is
exact: padded keys come after every real query (causal mask), padded lookahead values are
zero, and padded head dims add zero to every dot product. The XLA-side pieces (the in-block
scores and the softmax shift) are `common`'s, shared with the Mosaic path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.castle import triton_kernels
from pallas_kernels.castle.common import fold_in_block_grad, in_block_scores, normalize_with_safe_shift
from pallas_kernels.castle.config import CastleTritonConfig, default_triton_config
from pallas_kernels.config_checks import next_power_of_two
from pallas_kernels.residuals import keep_for_backward

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _forward(q_u, k_u, v_u, q_c, k_c, v_c, scale, window, config, interpret):
  """Returns out (float32 [BH, L, D]), lse (float32 [BH, L]) and the final D."""
  in_block = in_block_scores(q_c, v_u, scale, config.block_q)
  run = functools.partial(
    triton_kernels.forward,
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
  in_block = in_block_scores(q_c, v_u, scale, block_q)
  dq_u, dk_c, dv_c, dq_c, dk_u, dv_u, d_in_block = triton_kernels.backward(
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
