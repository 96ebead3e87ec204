"""What the tree-attention tests share: random inputs (caches partly filled, random or chain
trees, grouped heads), a float64 loop over the definition, and the jitted oracle and XLA
path."""

from __future__ import annotations
import functools

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.ops.tree_attention import (
  cache_attention,
  masked_tree_attention,
  merge_attention,
  tree_attention,
  tree_attention_reference,
)


TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


# Compiled once per shape: far faster on CPU than dispatching every op eagerly. (The
# concrete-value checks of the entry points run in the eager tests below.)
reference = jax.jit(tree_attention_reference)


xla = jax.jit(functools.partial(tree_attention, implementation="xla", return_lse=True))


jit_cache_attention = jax.jit(cache_attention, static_argnames="implementation")


def jitted_kernel(implementation: str, default_config=None):
  """`tree_attention(..., implementation=implementation, return_lse=True)` compiled per
  shape and kernel config (`config=`, default `default_config`)."""

  @functools.partial(jax.jit, static_argnames="config")
  def run(q, cache_k, cache_v, cache_length, tree_k, tree_v, tree_mask, config=default_config):
    return tree_attention(
      q,
      cache_k,
      cache_v,
      cache_length,
      tree_k,
      tree_v,
      tree_mask,
      implementation=implementation,
      return_lse=True,
      kernel_config=config,
    )

  return run


def full_random_inputs(seed: int, batch: int, n: int, heads: int, kv_heads: int, head_dim: int, capacity: int, dtype):
  """Normal q, a full cache of `capacity` slots and a random tree of n nodes, in `dtype`:
  the GPU tests' inputs at real sizes (they set the cache lengths themselves)."""
  keys = jax.random.split(jax.random.key(seed), 5)
  normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return dict(
    q=normal(keys[0], (batch, n, heads, head_dim)),
    cache_k=normal(keys[1], (batch, capacity, kv_heads, head_dim)),
    cache_v=normal(keys[2], (batch, capacity, kv_heads, head_dim)),
    tree_k=normal(keys[3], (batch, n, kv_heads, head_dim)),
    tree_v=normal(keys[4], (batch, n, kv_heads, head_dim)),
    tree_mask=jnp.asarray(numpy_ancestors(random_parents(np.random.default_rng(seed), n))),
  )


jit_masked_tree_attention = jax.jit(masked_tree_attention)


jit_merge = jax.jit(merge_attention)


def random_parents(rng: np.random.Generator, n: int) -> np.ndarray:
  """A random tree in topological order: node i hangs off a random earlier node or the cache."""
  return np.array([rng.integers(-1, i) for i in range(n)], np.int32)


def chain_parents(n: int) -> np.ndarray:
  return np.arange(-1, n - 1, dtype=np.int32)


def numpy_ancestors(parents: np.ndarray) -> np.ndarray:
  """bool [n, n] by walking up from every node: the definition, independent of the op."""
  n = len(parents)
  mask = np.zeros((n, n), bool)
  for i in range(n):
    node = i
    while node != -1:
      mask[i, node] = True
      node = parents[node]
  return mask


def make_inputs(
  seed: int,
  *,
  batch: int = 2,
  n: int = 6,
  heads: int = 4,
  kv_heads: int = 2,
  head_dim: int = 8,
  capacity: int = 11,
  cache_length=7,
  tree: str = "random",
  dtype=jnp.float32,
) -> dict:
  """Keyword arguments of `tree_attention`: random q/k/v and one tree per batch row."""
  # numpy draws: jax.random would compile anew for every shape.
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  parents = np.stack([chain_parents(n) if tree == "chain" else random_parents(rng, n) for _ in range(batch)])
  return dict(
    q=normal(batch, n, heads, head_dim),
    cache_k=normal(batch, capacity, kv_heads, head_dim),
    cache_v=normal(batch, capacity, kv_heads, head_dim),
    cache_length=jnp.asarray(cache_length, jnp.int32),
    tree_k=normal(batch, n, kv_heads, head_dim),
    tree_v=normal(batch, n, kv_heads, head_dim),
    tree_mask=jnp.asarray(np.stack([numpy_ancestors(p) for p in parents])),
  )


def numpy_tree_attention(q, cache_k, cache_v, cache_length, tree_k, tree_v, tree_mask):
  """float64 loop over batch, head and query: an explicit softmax over the visible keys."""
  q, cache_k, cache_v, tree_k, tree_v = (np.asarray(x, np.float64) for x in (q, cache_k, cache_v, tree_k, tree_v))
  batch, n, heads, head_dim = q.shape
  group = heads // cache_k.shape[2]
  lengths = np.broadcast_to(np.asarray(cache_length), (batch,))
  mask = np.broadcast_to(np.asarray(tree_mask), (batch, n, n))
  out = np.zeros(q.shape)
  lse = np.full((batch, n, heads), -np.inf)
  for b in range(batch):
    for h in range(heads):
      kv = h // group
      for i in range(n):
        keys = np.concatenate([cache_k[b, : lengths[b], kv], tree_k[b, mask[b, i], kv]])
        values = np.concatenate([cache_v[b, : lengths[b], kv], tree_v[b, mask[b, i], kv]])
        if not len(keys):
          continue
        scores = keys @ q[b, i, h] / np.sqrt(head_dim)
        top = scores.max()
        weights = np.exp(scores - top)
        lse[b, i, h] = top + np.log(weights.sum())
        out[b, i, h] = weights @ values / weights.sum()
  return out, lse


def upcast(inputs: dict) -> dict:
  return {name: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for name, x in inputs.items()}


HAND_PARENTS = [-1, -1, 0, 0, 1, 2]  # two roots; 5 -> 2 -> 0


HAND_MASK = np.array(
  [
    [1, 0, 0, 0, 0, 0],
    [0, 1, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0],
    [1, 0, 0, 1, 0, 0],
    [0, 1, 0, 0, 1, 0],
    [1, 0, 1, 0, 0, 1],
  ],
  bool,
)


SPLIT_CONFIGS = [
  dict(),
  dict(heads=6, kv_heads=1, head_dim=4),
  dict(n=1),
  dict(n=1, cache_length=0),
  dict(cache_length=0, tree="chain"),
  dict(cache_length=11),
  dict(cache_length=[0, 11]),
  dict(cache_length=[3, 8], tree="chain", batch=2),
  dict(batch=3, n=7, heads=2, kv_heads=2, capacity=13, cache_length=[1, 13, 6]),
]


def _replace(name, value):
  return lambda inputs: {**inputs, name: value(inputs[name]) if callable(value) else value}
