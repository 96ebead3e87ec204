"""The CASTLE Mosaic GPU backward on CPU: GPU interpret mode runs the same kernel code
(both warpgroups as concurrent threads, their barriers, TMA copies, wgmma), and the
Mosaic lowering of forward and backward for an H100 runs on CPU too.

All six gradients under a random cotangent against autodiff of the naive parallel form
(`castle_parallel`, float32, full-precision matmuls; an independent implementation):
CASTLE and CASTLE-SWL with windows above and below the block size, a length that is
not a multiple of the blocks, head dims 64 and 128. Interpret mode differs from the GPU
where the forward does (module docstring of `mosaic_backward`); the lowering test
covers the GPU variant.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle.reference import castle_parallel
from helpers import mosaic_kernels_lowered_for_h100, rel_err
from pallas_kernels.castle.mosaic import castle_attention_mosaic

_NAMES = ("q_u", "k_u", "v_u", "q_c", "k_c", "v_c")


def _inputs(seed, shape, dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(seed), 7)
  inputs = tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys[:6])
  return inputs, jax.random.normal(keys[6], shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize(
  "shape, window, cotangent_scale",
  [
    ((1, 100, 2, 64), None, 1.0),  # ragged: 100 tokens in blocks of 64
    ((1, 200, 1, 64), 70, 1.0),  # SWL, the window longer than a block; steps past it
    ((1, 192, 1, 128), 5, 1.0),  # head dim 128, a window inside one block; steps past it
    ((1, 130, 1, 128), None, 1.0),  # head dim 128 without a window: the lookahead path every step
    # A training loss's cotangents (a mean over many tokens): without rescaling, the float16
    # lookahead products would see them as subnormals (d{q,k,v}_u 40-80% off).
    ((1, 100, 2, 64), None, 1e-6),
  ],
)
def test_gradients_match_the_parallel_form(shape, window, cotangent_scale):
  inputs, cotangent = _inputs(shape[1] + (window or 0), shape)
  cotangent = (cotangent.astype(jnp.float32) * cotangent_scale).astype(cotangent.dtype)
  out, vjp = jax.vjp(lambda *a: castle_attention_mosaic(*a, window=window, interpret=True), *inputs)
  grads = vjp(cotangent)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_vjp = jax.vjp(lambda *a: castle_parallel(*a, window=window), *f32)
    ref_grads = ref_vjp(cotangent.astype(jnp.float32))
  assert out.dtype == jnp.bfloat16 and out.shape == shape
  assert rel_err(out.astype(jnp.float32), ref_out) < 1e-2
  for name, grad, ref, x in zip(_NAMES, grads, ref_grads, inputs):
    assert grad.dtype == x.dtype and grad.shape == shape, name
    grad = np.asarray(grad.astype(jnp.float32))
    assert np.isfinite(grad).all(), f"d{name} has unwritten or non-finite elements"
    # bf16 inputs and gradients, float16 lookahead products: errors ~3e-3.
    error = rel_err(grad, ref)
    assert error < 1e-2, f"d{name}: relative error {error:.3g}"


def test_backward_lowers_for_hopper():
  """The Mosaic GPU lowering of the backward kernel (layouts, wgmma shapes and dtypes,
  TMA reduce-adds, the two warpgroups, shared memory within 227 KB) for an H100 on CPU."""
  inputs, _ = _inputs(0, (1, 128, 2, 128))
  for window in (None, 512):
    loss = lambda *a: jnp.sum(castle_attention_mosaic(*a, window=window, interpret=False).astype(jnp.float32))
    kernels = mosaic_kernels_lowered_for_h100((loss, jax.grad(loss, argnums=tuple(range(6)))), inputs)
    # The forward's kernels and the backward's: under a window also the past-window key-side and dQ^C kernels.
    assert kernels[0] >= 1 and kernels[1] == kernels[0] + (1 if window is None else 3)


def test_rematerialized_forward_still_runs_its_kernel():
  """Under jax.checkpoint the backward pass recomputes the forward: its kernel calls must be
  there again. (Kernels writing `jax.new_ref` outputs were dropped from the recomputation,
  which then read zeros: NaN outputs and gradients in a rematerialized model.)"""
  inputs, _ = _inputs(0, (1, 128, 2, 64))
  loss = lambda *a: jnp.sum(jnp.tanh(castle_attention_mosaic(*a, interpret=False).astype(jnp.float32)))
  kernels = mosaic_kernels_lowered_for_h100(
    (
      loss,
      jax.value_and_grad(loss, argnums=tuple(range(6))),
      jax.value_and_grad(jax.checkpoint(loss), argnums=tuple(range(6))),
    ),
    inputs,
  )
  # The value's forward, then the recomputed one, then the backward.
  forward, plain, rematerialized = kernels
  assert rematerialized == plain + forward, kernels


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda x: x.astype(jnp.float32), "bfloat16 or float16"),
    (lambda x: x[..., :32], "head_dim"),
    (lambda x: x[0], r"q_u must be \[batch, seq, heads, head_dim\]"),
  ],
)
def test_rejects_what_the_kernels_cannot_take(change, message):
  inputs, _ = _inputs(0, (1, 64, 1, 64))
  with pytest.raises(ValueError, match=message):
    jax.grad(lambda *a: jnp.sum(castle_attention_mosaic(*a)))(*(change(x) for x in inputs))


def test_rejects_bad_windows():
  inputs, _ = _inputs(0, (1, 64, 1, 64))
  with pytest.raises(ValueError, match=r"window must be None or an int >= 1, got 0"):
    castle_attention_mosaic(*inputs, window=0)
