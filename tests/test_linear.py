"""Linear: the one-row product (batch-1 decoding) equals the plain tensordot, values and gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.layers.linear import Linear


@pytest.mark.parametrize(
  "x_shape, features, axes, contract_dims",
  [
    ((1, 1, 16), (4, 8), ("embed", "heads", "head_dim"), 1),  # one token of one sequence: K/V projections
    ((1, 4, 8), (16,), ("heads", "head_dim", "embed"), 2),  # an output projection over two axes
    ((16,), (8,), ("embed", "mlp"), 1),  # no leading axes
    ((3, 1, 16), (8,), ("embed", "mlp"), 1),  # several rows: the plain product
  ],
)
def test_matches_tensordot_values_and_gradients(x_shape, features, axes, contract_dims):
  layer = Linear(features=features, axes=axes, contract_dims=contract_dims, use_bias=True)
  x = jax.random.normal(jax.random.key(0), x_shape)
  params = nn.unbox(layer.init(jax.random.key(1), x))
  params = jax.tree.map(lambda p: p + jax.random.normal(jax.random.key(2), p.shape), params)  # a nonzero bias

  def plain(params, x):
    p = params["params"]
    return jnp.tensordot(x, p["kernel"], axes=contract_dims) + p["bias"]

  y = layer.apply(params, x)
  assert y.shape == (*x_shape[: len(x_shape) - contract_dims], *features)
  np.testing.assert_allclose(y, plain(params, x), rtol=1e-6, atol=1e-6)
  cotangent = jax.random.normal(jax.random.key(3), y.shape)
  grads = jax.grad(lambda p, x: jnp.sum(layer.apply(p, x) * cotangent), argnums=(0, 1))(params, x)
  expected = jax.grad(lambda p, x: jnp.sum(plain(p, x) * cotangent), argnums=(0, 1))(params, x)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), grads, expected)


def test_one_row_is_a_two_row_matrix_product():
  """The reason for the two rows: the compiled product must not be a vector-matrix product."""
  layer = Linear(features=(8,), axes=("embed", "mlp"))
  x = jnp.ones((1, 1, 16))
  params = nn.unbox(layer.init(jax.random.key(0), x))
  text = jax.jit(layer.apply).lower(params, x).as_text()
  assert "dot_general" in text and "tensor<2x16xf32>" in text, text
