"""Tree masks from parent lists (`castle_jax.ops.tree_attention.masks`): a hand-written tree, eager
and under jit, against walking up the parents, and parent lists that are refused.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.tree_attention import (
  node_depths,
  tree_mask_from_parents,
)
from ops.tree_attention.base import HAND_MASK, HAND_PARENTS, chain_parents, numpy_ancestors, random_parents


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def test_mask_and_depths_of_a_hand_written_tree_eager_and_jit():
  parents = jnp.array(HAND_PARENTS, jnp.int32)
  for mask_fn, depth_fn in (
    (tree_mask_from_parents, node_depths),
    (jax.jit(tree_mask_from_parents), jax.jit(node_depths)),
  ):
    mask = mask_fn(parents)
    chex.assert_type(mask, jnp.bool_)
    np.testing.assert_array_equal(mask, HAND_MASK)
    np.testing.assert_array_equal(depth_fn(parents), [0, 0, 1, 1, 1, 2])
  # A batch of trees: the hand-written one and a chain (the deepest tree of 6 nodes).
  batched = jnp.array([HAND_PARENTS, chain_parents(6)], jnp.int32)
  np.testing.assert_array_equal(jax.jit(tree_mask_from_parents)(batched), [HAND_MASK, np.tril(np.ones((6, 6), bool))])
  np.testing.assert_array_equal(jax.jit(node_depths)(batched), [[0, 0, 1, 1, 1, 2], np.arange(6)])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 17])
def test_mask_matches_walking_up_the_parents(n):
  # Chains have the longest paths: they check that enough squarings are taken.
  rng = np.random.default_rng(n)
  parents = np.stack([chain_parents(n), random_parents(rng, n), random_parents(rng, n)])
  expected = np.stack([numpy_ancestors(p) for p in parents])
  np.testing.assert_array_equal(jax.jit(tree_mask_from_parents)(parents), expected)
  np.testing.assert_array_equal(node_depths(parents), expected.sum(-1) - 1)


@pytest.mark.parametrize("parents", [[-1, 1], [-1, 0, 2], [-1, 0, 5], [-2, 0], [[-1, 0], [-1, 1]]])
def test_parents_out_of_topological_order_are_refused(parents):
  with pytest.raises(ValueError, match=r"parents.*-1 <= parents\[i\] < i"):
    tree_mask_from_parents(jnp.array(parents, jnp.int32))


@pytest.mark.parametrize(
  "parents, match",
  [(np.zeros((1, 2, 3), np.int32), "parents must be int"), (np.array([-1.0, 0.0]), "parents must hold integer")],
)
def test_parents_of_a_bad_shape_or_dtype_are_refused(parents, match):
  with pytest.raises(ValueError, match=match):
    tree_mask_from_parents(parents)
