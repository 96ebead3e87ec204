"""The state expansions (`castle_jax.ops.power.expansion`): phi(q) . phi(k) = (q . k)^p in float64,
the dimensions of the paper's Table 3, its spow examples, and tspow between spow and tpow.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import (
  expanded_dim,
  spow,
  tpow,
  tspow,
)
from castle_jax.ops.power.expansion import expansion_table
from helpers import rel_err
from ops.power.base import expanded_inner_product


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


@pytest.mark.parametrize("head_dim", [4, 8, 64])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("expansion", ["tpow", "spow", "tspow"])
def test_expansion_inner_product_is_the_power_float64(head_dim, p, expansion):
  if expansion == "tpow" and head_dim**p > 10**6:
    pytest.skip("tpow of d=64, p=4 has 16.7M dimensions")
  with jax.enable_x64(True):
    q, k = jnp.asarray(np.random.default_rng(head_dim + p).standard_normal((2, 3, head_dim)))
    inner, dim = expanded_inner_product(q, k, p, expansion)
    assert dim == expanded_dim(head_dim, p, expansion)
    expected = np.sum(np.asarray(q) * np.asarray(k), axis=-1) ** p
    assert rel_err(inner, expected) < 1e-13


def test_dimensions_match_table3():
  # Table 3 of the paper: d = 64, p = 2 .. 6.
  table3 = {
    2: (4096, 2080),
    3: (262144, 45760),
    4: (16777216, 766480),
    5: (1073741824, 10424128),
    6: (68719476736, 119877472),
  }
  for p, (tpow_dim, spow_dim) in table3.items():
    assert expanded_dim(64, p, "tpow") == tpow_dim
    assert expanded_dim(64, p, "spow") == spow_dim
  # tspow: C(d / d_tile + p - 1, p) * d_tile^p (Sec. 4.1.1).
  assert expanded_dim(64, 2, "tspow", 8) == math.comb(9, 2) * 64 == 2304
  assert expanded_dim(64, 3, "tspow", 4) == math.comb(18, 3) * 64
  for head_dim, p, expansion, d_tile in [
    (8, 2, "spow", None),
    (8, 4, "spow", None),
    (8, 3, "tpow", None),
    (8, 2, "tspow", 2),
    (12, 4, "tspow", 3),
  ]:
    idx, weights = expansion_table(head_dim, p, expansion, d_tile)
    assert idx.shape == (expanded_dim(head_dim, p, expansion, d_tile), p) and weights.shape == idx.shape[:1]


def test_spow_matches_the_papers_examples():
  with jax.enable_x64(True):
    x1, x2 = 1.5, -0.7
    x = jnp.array([x1, x2])
    np.testing.assert_allclose(spow(x, 2), [x1 * x1, math.sqrt(2) * x1 * x2, x2 * x2], rtol=1e-15)
    np.testing.assert_allclose(
      spow(x, 3), [x1**3, math.sqrt(3) * x1 * x1 * x2, math.sqrt(3) * x1 * x2 * x2, x2**3], rtol=1e-15
    )


def test_tspow_interpolates_between_spow_and_tpow():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8)))
    np.testing.assert_array_equal(tspow(x, 2, d_tile=1), spow(x, 2))
    np.testing.assert_array_equal(tspow(x, 3, d_tile=8), tpow(x, 3))
    # Unweighted symmetric entries break the identity: the weights are needed.
    idx, _ = expansion_table(8, 2, "spow")
    unweighted = jnp.prod(x[..., idx], axis=-1)
    assert rel_err(jnp.sum(unweighted[0] * unweighted[1]), jnp.sum(x[0] * x[1]) ** 2) > 1e-2
