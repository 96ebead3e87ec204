"""`castle_attention`'s kernel implementations on a GPU (skipped without a CUDA GPU; the
Mosaic cases skip on GPUs other than Hopper).

`implementation="mosaic"` compiles the Mosaic GPU kernels (checked in the lowered program)
and matches the blockwise XLA path in float32, output and all six gradients under a random
cotangent, CASTLE and CASTLE-SWL at a ragged length; the default (implementation=None) runs
and matches too, whichever kernels it picks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import castle_attention
from helpers import rel_err
from ops.castle.base import NAMES, jitted_grads, random_inputs
from pallas_kernels.device_facts import compute_capability, is_hopper


pytestmark = pytest.mark.gpu

SHAPE = (2, 1000, 4, 128)  # 1000 tokens: a ragged last block


def _castle(implementation, window):
  return lambda *a: castle_attention(*a, window=window, implementation=implementation)


def _check_against_xla(attention, window, seed):
  inputs, cotangent = random_inputs(seed, SHAPE)
  out = jax.jit(attention)(*inputs)
  grads = jitted_grads(attention, inputs, cotangent)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  xla = lambda *a: castle_attention(*a, window=window, implementation="xla")
  with jax.default_matmul_precision("highest"):
    ref_out = jax.jit(xla)(*f32)
    ref_grads = jitted_grads(xla, f32, cotangent)
  assert out.dtype == jnp.bfloat16 and out.shape == SHAPE
  assert rel_err(out.astype(jnp.float32), ref_out) < 1e-2
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    grad = np.asarray(grad.astype(jnp.float32))
    assert np.isfinite(grad).all(), f"d{name} is not finite"
    error = rel_err(grad, ref)
    assert error < 1e-2, f"d{name}: relative error {error:.3g}"


@pytest.mark.parametrize("window", [None, 200])
def test_mosaic_matches_xla(window):
  if not is_hopper(compute_capability()):
    pytest.skip(f"the Mosaic GPU kernels need compute capability 9.x, got {compute_capability()}")
  attention = _castle("mosaic", window)
  inputs, _ = random_inputs(0, SHAPE)
  loss = lambda *a: jnp.sum(attention(*a).astype(jnp.float32))
  lowered = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).lower(*inputs).as_text()
  assert lowered.count("custom_call @mosaic_gpu") >= 2  # forward and backward kernels, not Triton's
  _check_against_xla(attention, window, seed=1 + (window or 0))


def test_the_default_runs_and_matches_xla():
  _check_against_xla(_castle(None, 200), 200, seed=3)
