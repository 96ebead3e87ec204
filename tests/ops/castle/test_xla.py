"""The blockwise XLA path (Algorithms 1 and 3, `castle_jax.ops.castle.xla`) against the parallel
form and the recurrent definition: outputs and all six gradients, CASTLE and CASTLE-SWL, block
sizes that do not divide the length, length one, bf16 inputs, causality, and memory linear in
the length.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import castle_blockwise, castle_parallel
from helpers import rel_err
from ops.castle.base import SHAPE, blockwise, math_inputs, parallel, recurrent


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


@pytest.mark.parametrize("block_size, window", [(4, None), (5, 3), (1, None), (3, 1), (16, None), (4, 30), (2, 6)])
def test_blockwise_matches_parallel_float32(block_size, window):
  inputs = math_inputs(seed=10 + block_size)
  out = blockwise(inputs, window, block_size)
  assert out.shape == SHAPE and out.dtype == jnp.float32
  assert rel_err(out, parallel(inputs, window)) < 1e-5


@pytest.mark.parametrize("window", [None, 2])
def test_blockwise_matches_recurrent_float64(window):
  with jax.enable_x64(True):
    inputs = math_inputs(seed=20, dtype=jnp.float64)
    out = blockwise(inputs, window, 4)
    assert out.dtype == jnp.float64
    assert rel_err(out, recurrent(inputs, window)) < 1e-12


def test_length_one():
  inputs = math_inputs(seed=21, shape=(2, 1, 3, 8))
  expected = recurrent(inputs, None)
  # One token: the output is v^C_1 whatever the scores.
  assert rel_err(expected, inputs[5]) < 1e-6
  assert rel_err(blockwise(inputs, None, 4), expected) < 1e-6
  assert rel_err(parallel(inputs, 3), expected) < 1e-6


@pytest.mark.parametrize("window", [None, 3])
def test_blockwise_bf16_inputs(window):
  inputs = math_inputs(seed=22, dtype=jnp.bfloat16)
  out = blockwise(inputs, window, 4)
  assert out.dtype == jnp.bfloat16
  expected = parallel(tuple(x.astype(jnp.float32) for x in inputs), window)
  assert rel_err(out.astype(jnp.float32), expected) < 1e-2


@pytest.mark.parametrize("block_size, window", [(4, None), (5, 3), (1, 2)])
def test_blockwise_gradients_match_parallel_autodiff(block_size, window):
  inputs = math_inputs(seed=30 + block_size)
  cotangent = jax.random.normal(jax.random.key(31), SHAPE)

  def loss(fn):
    return lambda *args: jnp.sum(fn(*args) * cotangent)

  grad_fn = functools.partial(jax.grad, argnums=tuple(range(6)))
  expected = jax.jit(grad_fn(loss(functools.partial(castle_parallel, window=window))))(*inputs)
  grads = jax.jit(grad_fn(loss(functools.partial(castle_blockwise, window=window, block_size=block_size))))(*inputs)
  for name, grad, ref in zip(("q_u", "k_u", "v_u", "q_c", "k_c", "v_c"), grads, expected):
    assert rel_err(grad, ref) < 1e-5, name


def test_blockwise_gradient_at_length_one():
  inputs = math_inputs(seed=32, shape=(1, 1, 2, 8))
  grads = jax.grad(lambda *a: jnp.sum(castle_blockwise(*a) ** 2), argnums=tuple(range(6)))(*inputs)
  # o_1 = v^C_1 whatever the scores, so only v^C gets a gradient (up to rounding in
  # dP - Delta, which computes dO . v^C twice).
  for grad in grads[:5]:
    assert np.max(np.abs(np.asarray(grad))) < 1e-5
  assert rel_err(grads[5], 2 * inputs[5]) < 1e-6


@pytest.mark.parametrize("window", [None, 2])
def test_blockwise_is_causal(window):
  inputs = math_inputs(seed=40)
  last_kept = 5
  noise = math_inputs(seed=41)
  future = (jnp.arange(SHAPE[1]) > last_kept)[None, :, None, None]
  perturbed = tuple(x + jnp.where(future, 100.0 * n, 0.0) for x, n in zip(inputs, noise))
  out = blockwise(inputs, window, 4)
  out_perturbed = blockwise(perturbed, window, 4)
  np.testing.assert_array_equal(out[:, : last_kept + 1], out_perturbed[:, : last_kept + 1])
  assert rel_err(out_perturbed[:, last_kept + 1 :], out[:, last_kept + 1 :]) > 1e-2


def test_blockwise_memory_is_linear_in_length():
  """The gradient program holds no [T, T] array and its scratch grows ~linearly in T."""

  def compiled(seq):
    spec = jax.ShapeDtypeStruct((1, seq, 1, 16), jnp.float32)
    grad = jax.grad(lambda *a: jnp.sum(castle_blockwise(*a, block_size=32)), argnums=tuple(range(6)))
    return jax.jit(grad).lower(*[spec] * 6).compile()

  small, large = compiled(2048), compiled(4096)
  temp_small = small.memory_analysis().temp_size_in_bytes
  temp_large = large.memory_analysis().temp_size_in_bytes
  assert temp_large < 2.5 * temp_small
  assert temp_large < 4096 * 4096 * 4 / 4  # a quarter of one [T, T] float32 array
  assert "4096,4096]" not in large.as_text()
