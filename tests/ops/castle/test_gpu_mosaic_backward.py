"""The compiled CASTLE Mosaic GPU backward on a Hopper GPU (skipped without a CUDA GPU).

All six gradients of `castle_attention_mosaic` under a random cotangent against the VJP
of the blockwise XLA path in float32 with full-precision matmuls, at real head sizes
(9 heads x 128 at 2K tokens, head dim 64), CASTLE and CASTLE-SWL, ragged lengths and a
single token. This is the first check of what interpret mode cannot show for the
backward: the two warpgroups' barriers and shared-memory hand-offs under real
concurrency, the TMA reduce-adds across programs, register wgmma operands and ptxas.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle.xla import castle_blockwise
from helpers import rel_err
from ops.castle.base import GPU_CASES, NAMES, jitted_grads, random_inputs
from pallas_kernels.castle import castle_attention_triton
from pallas_kernels.castle.mosaic import castle_attention_mosaic

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
  "shape, window",
  GPU_CASES
  + [
    # CASTLE-SWL with most pairs past the window (dQ^C in the query-major kernel, dK^C, dV^C
    # and dD in a key-side kernel of their own):
    ((1, 16384, 2, 128), 512),  # ~97% of the pairs past the window
    ((1, 3000, 4, 128), 100),  # ragged, a window between one and two blocks
    ((2, 2048, 4, 64), 64),  # head dim 64, a window of one block
  ],
)
def test_mosaic_gradients_match_xla(shape, window):
  inputs, cotangent = random_inputs(shape[1] + (window or 0), shape)
  loss = lambda *a: jnp.sum(castle_attention_mosaic(*a, window=window).astype(jnp.float32))
  kernels = [
    jax.jit(f).lower(*inputs).as_text().count("custom_call @mosaic_gpu")
    for f in (loss, jax.grad(loss, argnums=tuple(range(6))))
  ]
  # The forward's kernels and the backward's: under a window also the past-window key-side and dQ^C kernels.
  assert kernels[0] >= 1 and kernels[1] == kernels[0] + (1 if window is None else 3)
  grads = jitted_grads(lambda *a: castle_attention_mosaic(*a, window=window), inputs, cotangent)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_grads = jitted_grads(lambda *a: castle_blockwise(*a, window=window), f32, cotangent)
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    grad = np.asarray(grad.astype(jnp.float32))
    assert grad.dtype == np.float32 and np.isfinite(grad).all(), f"d{name} is not finite"
    error = rel_err(grad, ref)
    # A single token has exactly zero gradients for all but v_c, where a relative error
    # is undefined: the kernel's rounding noise (~1e-7) must then stay absolute-small.
    assert error < 1e-2 or np.abs(grad - np.asarray(ref)).max() < 1e-5, f"d{name}: relative error {error:.3g}"


def test_mosaic_gradients_match_triton():
  """Against the Triton kernels' VJP (same float16 lookahead operands) at 2K tokens."""
  shape = (1, 2048, 4, 128)
  inputs, cotangent = random_inputs(5, shape)
  scale = shape[-1] ** -0.5
  grads = jitted_grads(lambda *a: castle_attention_mosaic(*a, scale=scale), inputs, cotangent)
  ref_grads = jitted_grads(lambda *a: castle_attention_triton(*a, scale=scale), inputs, cotangent)
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    error = rel_err(grad.astype(jnp.float32), ref.astype(jnp.float32))
    assert error < 1e-2, f"d{name}: relative error {error:.3g}"


def test_rematerialized_training_loss_matches_triton():
  """As inside a training step: jax.checkpoint around the attention (the backward pass
  recomputes the forward) and a mean loss over all tokens, whose cotangents (~1e-6) the
  float16 lookahead products would hold only as subnormals without the backward's rescaling.
  Both failed before: NaN from the recomputation, lookahead gradients 40-80% off."""
  shape = (1, 4096, 9, 128)
  inputs, _ = random_inputs(11, shape)
  scale = shape[-1] ** -0.5

  def mean_loss(attention):
    return jax.checkpoint(lambda *a: jnp.mean(jnp.tanh(attention(*a).astype(jnp.float32))))

  mosaic = lambda *a: castle_attention_mosaic(*a, scale=scale, window=512)
  triton = lambda *a: castle_attention_triton(*a, scale=scale, window=512)
  (value, grads), (ref_value, ref_grads) = (
    jax.jit(jax.value_and_grad(mean_loss(f), argnums=tuple(range(6))))(*inputs) for f in (mosaic, triton)
  )
  assert np.isfinite(float(value)) and abs(float(value) - float(ref_value)) < 1e-3 * abs(float(ref_value)) + 1e-6
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    grad = np.asarray(grad.astype(jnp.float32))
    assert np.isfinite(grad).all(), f"d{name} is not finite"
    error = rel_err(grad, ref.astype(jnp.float32))
    assert error < 1e-2, f"d{name}: relative error {error:.3g}"
