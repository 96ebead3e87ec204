"""Tree masks for speculative verification: which drafted nodes each node may see.

A drafted tree of n nodes is given by its parent list, in topological order (a parent
comes before its children): parents[i] is the index of node i's parent within the
tree, or -1 for a root, a node that hangs directly off the committed cache. Node i sees
itself and its ancestors, i.e. exactly the tokens that precede it on its own branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _check_parents(parents: jax.Array) -> None:
  """Shape and dtype always; topological order only when the values are concrete."""
  if parents.ndim not in (1, 2):
    raise ValueError(f"parents must be int [n] or [batch, n]; got shape {parents.shape}")
  if not jnp.issubdtype(parents.dtype, jnp.integer):
    raise ValueError(f"parents must hold integer node indices, got dtype {parents.dtype}")
  if isinstance(parents, jax.core.Tracer):
    return  # under jit the values are unknown: the caller builds valid trees
  values = np.asarray(parents)
  nodes = np.arange(values.shape[-1])
  bad = (values < -1) | (values >= nodes)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"parents must satisfy -1 <= parents[i] < i (nodes in topological order, -1 for a root); "
      f"parents{list(where)} = {int(values[where])}: list every node after its parent"
    )


def tree_mask_from_parents(parents: jax.Array) -> jax.Array:
  """Which drafted nodes each node attends to: itself and its ancestors.

  The ancestor relation is the transitive closure of "j is i's parent", computed by
  repeated boolean squaring of the (self | parent) matrix: after s squarings it holds
  every path of up to 2^s hops, and no path in a tree of n nodes has more than n - 1.
  The number of squarings depends on n alone, so this runs under jit with traced parents.

  Args:
    parents: int [n] or [batch, n]; parents[..., i] is node i's parent index in the
      tree, -1 for a root; parents[..., i] < i is required (checked, raising ValueError,
      when the values are concrete; under jit an invalid list gives an unspecified mask).

  Returns:
    bool [..., n, n] (the leading shape of `parents`): mask[..., i, j] is True iff
    j == i or node j is an ancestor of node i.
  """
  parents = jnp.asarray(parents)
  _check_parents(parents)
  n = parents.shape[-1]
  nodes = jnp.arange(n, dtype=parents.dtype)
  # One hop: itself or its parent (a root's -1 matches no column).
  reach = (nodes[:, None] == nodes[None, :]) | (parents[..., :, None] == nodes[None, :])
  longest_path = max(n - 1, 0)
  for _ in range(max(longest_path - 1, 0).bit_length()):  # ceil(log2(longest_path)) squarings
    hops = reach.astype(jnp.int32)
    reach = jnp.matmul(hops, hops) > 0
  return reach


def node_depths(parents: jax.Array) -> jax.Array:
  """Depth of each drafted node: 0 for a root, 1 for its children, and so on.

  Args:
    parents: int [n] or [batch, n], as `tree_mask_from_parents` takes it.

  Returns:
    int32 [..., n]: the number of ancestors of each node within the tree (a node's
    position after the committed cache is cache_length + depth).
  """
  return jnp.sum(tree_mask_from_parents(parents), axis=-1, dtype=jnp.int32) - 1
