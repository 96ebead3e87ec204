"""The Mosaic CASTLE kernels' sigmoid, SiLU and SiLU' (`pallas_kernels.castle.mosaic_math`)
against jax.nn on CPU, over the whole float32 range the kernels see, ends included."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.castle import mosaic_math


def _points():
  return jnp.concatenate([jnp.linspace(-30.0, 30.0, 20001), jnp.array([-1e4, -200.0, -88.0, 88.0, 200.0, 1e4, 0.0])])


def test_sigmoid_matches_jax_nn():
  x = _points()
  got, want = np.asarray(mosaic_math.sigmoid(x)), np.asarray(jax.nn.sigmoid(x))
  assert np.isfinite(got).all() and (got >= 0).all() and (got <= 1).all()
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30)
  # e^-x overflows to inf far left: the root is 0, and so is the sigmoid (no NaN).
  assert float(mosaic_math.sigmoid(jnp.float32(-1e4))) == 0.0


def test_silu_and_its_gradient_match_autodiff():
  x = _points()
  want_grad = jax.vmap(jax.grad(jax.nn.silu))(x)
  silu, silu_grad = mosaic_math.silu_and_grad(x)
  np.testing.assert_allclose(silu, jax.nn.silu(x), rtol=1e-6, atol=1e-30)
  np.testing.assert_allclose(silu_grad, want_grad, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(mosaic_math.silu(x), silu, rtol=0, atol=0)
  np.testing.assert_allclose(mosaic_math.silu_grad(x), silu_grad, rtol=1e-6, atol=1e-7)
