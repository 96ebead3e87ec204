"""Hybrid tree attention: tree masks from parent lists, the dense reference against a
float64 loop, the split ("xla") path against the reference (plain and under jit with
traced lengths), poisoned empty cache slots, the LSE merge, and input checks."""

from __future__ import annotations

import functools
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.tree_attention import (
  IMPLEMENTATIONS,
  cache_attention,
  masked_tree_attention,
  merge_attention,
  node_depths,
  tree_attention,
  tree_attention_reference,
  tree_mask_from_parents,
)
from helpers import assert_close, rel_err

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# Compiled once per shape: far faster on CPU than dispatching every op eagerly. (The
# concrete-value checks of the entry points run in the eager tests below.)
reference = jax.jit(tree_attention_reference)
xla = jax.jit(functools.partial(tree_attention, implementation="xla", return_lse=True))
jit_cache_attention = jax.jit(cache_attention, static_argnames="implementation")
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


# --- tree masks -------------------------------------------------------------------------

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


# --- the reference against the float64 loop --------------------------------------------


@pytest.mark.parametrize(
  "config",
  [
    dict(),
    dict(heads=6, kv_heads=1, n=3, cache_length=11),
    dict(n=1, cache_length=0),
    dict(cache_length=[0, 4], tree="chain"),
  ],
)
def test_reference_matches_float64_loop(config):
  inputs = make_inputs(1, **config)
  out, lse = reference(**inputs)
  expected_out, expected_lse = numpy_tree_attention(**inputs)
  assert rel_err(out, expected_out) < 1e-6
  assert rel_err(lse, expected_lse) < 1e-6


def test_cache_attention_reference_matches_float64_loop_including_an_empty_row():
  inputs = make_inputs(2, cache_length=[0, 9])
  no_tree = jnp.zeros((6, 6), bool)
  expected_out, expected_lse = numpy_tree_attention(**{**inputs, "tree_mask": no_tree})
  out, lse = jit_cache_attention(
    inputs["q"], inputs["cache_k"], inputs["cache_v"], inputs["cache_length"], implementation="reference"
  )
  np.testing.assert_array_equal(lse[0], -np.inf)
  np.testing.assert_array_equal(out[0], 0.0)
  assert rel_err(out, expected_out) < 1e-6
  assert rel_err(lse[1], expected_lse[1]) < 1e-6


# --- the split path against the reference ----------------------------------------------

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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("config", SPLIT_CONFIGS)
def test_xla_matches_reference(config, dtype):
  inputs = make_inputs(3, dtype=dtype, **config)
  out, lse = xla(**inputs)
  chex.assert_type(out, dtype)
  chex.assert_type(lse, jnp.float32)
  chex.assert_shape(lse, inputs["q"].shape[:3])
  # The oracle sees the same (rounded) inputs in float32: what is measured is the path's error.
  expected = reference(**upcast(inputs))
  assert_close((out, lse), expected, tol=TOLERANCE[dtype])


def test_one_compiled_function_serves_traced_lengths_and_trees():
  """A verification step under jit: parents, lengths and inputs all traced."""
  inputs = make_inputs(4)
  calls = []

  @jax.jit
  def verify(q, cache_k, cache_v, cache_length, tree_k, tree_v, parents):
    calls.append(1)  # counts traces
    mask = tree_mask_from_parents(parents)
    return tree_attention(q, cache_k, cache_v, cache_length, tree_k, tree_v, mask, return_lse=True)

  rng = np.random.default_rng(4)
  trees = [
    [HAND_PARENTS, chain_parents(6)],
    [random_parents(rng, 6), HAND_PARENTS],
    [chain_parents(6), random_parents(rng, 6)],
    [random_parents(rng, 6), random_parents(rng, 6)],
  ]
  for cache_length, tree in zip(([0, 0], [11, 11], [2, 7], [11, 0]), trees):
    parents = np.array(tree, np.int32)
    inputs.update(
      cache_length=jnp.array(cache_length, jnp.int32),
      tree_mask=jnp.asarray(np.stack([numpy_ancestors(p) for p in parents])),
    )
    args = [inputs[name] for name in ("q", "cache_k", "cache_v", "cache_length", "tree_k", "tree_v")]
    assert_close(verify(*args, parents), reference(**inputs))
  assert len(calls) == 1
  # A scalar length traces once more (another shape) and broadcasts to every row.
  scalar = jax.jit(functools.partial(tree_attention, return_lse=True))
  inputs["cache_length"] = jnp.int32(5)
  assert_close(scalar(**inputs), reference(**inputs))


# The kernel needs head dims >= 16: test_tree_attention_pallas.py poisons its empty slots.
@pytest.mark.parametrize("implementation", [name for name in IMPLEMENTATIONS if name != "triton"])
def test_empty_slots_do_not_leak(implementation):
  """Slots at or beyond each row's length hold huge values: the output must not move."""
  inputs = make_inputs(5, cache_length=[3, 8])
  beyond = (np.arange(11)[None, :] >= np.array([3, 8])[:, None])[:, :, None, None]
  fill = lambda name, value: jnp.asarray(np.where(beyond, value, inputs[name]), jnp.float32)
  clean = {**inputs, "cache_k": fill("cache_k", 0.0), "cache_v": fill("cache_v", 0.0)}
  poisoned = {**inputs, "cache_k": fill("cache_k", 1e4), "cache_v": fill("cache_v", -1e4)}
  run = jax.jit(functools.partial(tree_attention, implementation=implementation, return_lse=True))
  assert_close(run(**poisoned), run(**clean), tol=1e-6)


def test_nan_in_empty_slots_does_not_reach_the_xla_output():
  inputs = make_inputs(6, cache_length=[0, 6])
  beyond = (np.arange(11)[None, :] >= np.array([0, 6])[:, None])[:, :, None, None]
  poison = lambda name: jnp.asarray(np.where(beyond, np.nan, inputs[name]), jnp.float32)
  poisoned = {**inputs, "cache_k": poison("cache_k"), "cache_v": poison("cache_v")}
  assert_close(xla(**poisoned), reference(**inputs))
  cache_out, cache_lse = jit_cache_attention(*(poisoned[name] for name in ("q", "cache_k", "cache_v", "cache_length")))
  assert not np.isnan(np.asarray(cache_out)).any() and not np.isnan(np.asarray(cache_lse)).any()


# --- merging ---------------------------------------------------------------------------


def test_merged_parts_equal_attention_over_the_concatenation():
  inputs = make_inputs(7, cache_length=[5, 11])
  cache_part = jit_cache_attention(inputs["q"], inputs["cache_k"], inputs["cache_v"], inputs["cache_length"])
  tree_part = jit_masked_tree_attention(inputs["q"], inputs["tree_k"], inputs["tree_v"], inputs["tree_mask"])
  expected = reference(**inputs)
  assert_close(jit_merge(*cache_part, *tree_part), expected)
  assert_close(jit_merge(*tree_part, *cache_part), expected)


def test_a_cache_split_in_two_merges_back():
  inputs = make_inputs(8, capacity=12)
  q, k, v = inputs["q"], inputs["cache_k"], inputs["cache_v"]
  whole = jit_cache_attention(q, k, v, 10, implementation="reference")
  front = jit_cache_attention(q, k[:, :4], v[:, :4], 4)
  back = jit_cache_attention(q, k[:, 4:], v[:, 4:], 6)
  assert_close(jit_merge(*front, *back), whole)


def test_merge_with_an_empty_part_returns_the_other_part_exactly():
  inputs = make_inputs(9)
  empty_out, empty_lse = jit_cache_attention(inputs["q"], inputs["cache_k"], inputs["cache_v"], 0)
  np.testing.assert_array_equal(empty_out, 0.0)
  np.testing.assert_array_equal(empty_lse, -np.inf)
  tree_out, tree_lse = jit_masked_tree_attention(inputs["q"], inputs["tree_k"], inputs["tree_v"], inputs["tree_mask"])
  for merged_out, merged_lse in (
    jit_merge(empty_out, empty_lse, tree_out, tree_lse),
    jit_merge(tree_out, tree_lse, empty_out, empty_lse),
  ):
    np.testing.assert_array_equal(merged_out, tree_out)
    np.testing.assert_array_equal(merged_lse, tree_lse)
  # The whole op with an empty cache is the tree part alone.
  out, lse = xla(**{**inputs, "cache_length": jnp.int32(0)})
  np.testing.assert_array_equal(out, tree_out)
  np.testing.assert_array_equal(lse, tree_lse)
  # Both parts empty: zeros and -inf, no NaN.
  both_out, both_lse = jit_merge(empty_out, empty_lse, empty_out, empty_lse)
  np.testing.assert_array_equal(both_out, 0.0)
  np.testing.assert_array_equal(both_lse, -np.inf)


# --- implementation choice and input checks --------------------------------------------


def test_default_is_xla_and_logged(caplog):
  inputs = make_inputs(10)
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    out = jax.jit(tree_attention)(**inputs)  # the choice is made (and logged) while tracing
  assert "tree_attention: implementation=None -> 'xla'" in caplog.text
  chex.assert_shape(out, inputs["q"].shape)
  assert_close(out, reference(**inputs)[0])


def _replace(name, value):
  return lambda inputs: {**inputs, name: value(inputs[name]) if callable(value) else value}


@pytest.mark.parametrize(
  "change, match",
  [
    (_replace("q", lambda q: q[0]), r"q must have shape \[batch, n, heads, head_dim\]"),
    (_replace("q", lambda q: q.astype(jnp.int32)), "q must be floating"),
    (_replace("cache_k", lambda k: k[..., :4]), r"cache_k \(2, 11, 2, 4\) and cache_v"),
    (_replace("cache_v", lambda v: v[:, :5]), "cache_k .* and cache_v .* same shape"),
    (_replace("cache_k", lambda k: k[:, :, :, None]), "cache_k must have shape"),
    (lambda x: {**x, "cache_k": x["cache_k"][..., :4], "cache_v": x["cache_v"][..., :4]}, "cache_k/cache_v head_dim"),
    (lambda x: {**x, "cache_k": x["cache_k"][:1], "cache_v": x["cache_v"][:1]}, "cache_k batch"),
    (lambda x: {**x, "q": x["q"][:, :, :3]}, "kv_heads"),
    (_replace("cache_length", jnp.float32(3.0)), "cache_length must be an integer"),
    (_replace("cache_length", jnp.array([1, 2, 3], jnp.int32)), r"cache_length must be a scalar or have shape"),
    (_replace("cache_length", 12), r"cache_length must lie in 0 \.\. capacity \(11\)"),
    (_replace("cache_length", jnp.array([-1, 3], jnp.int32)), "cache_length must lie"),
    (_replace("tree_k", lambda k: k[:, :4]), r"tree_k must have shape \[batch, n, kv_heads, head_dim\]"),
    (_replace("tree_v", lambda v: v[:, :, :1]), "tree_v must have shape"),
    (_replace("tree_v", lambda v: v[0]), "tree_v must have shape"),
    (_replace("tree_mask", lambda m: m.astype(jnp.int32)), "tree_mask must be bool"),
    (_replace("tree_mask", lambda m: m[:, :, :4]), r"tree_mask must have shape \[batch, n, n\]"),
    (_replace("tree_mask", lambda m: m[:1]), "tree_mask must have shape"),
  ],
)
def test_bad_inputs_name_the_argument(change, match):
  with pytest.raises(ValueError, match=match):
    tree_attention(**change(make_inputs(11)))


def test_shared_mask_broadcasts_and_unknown_implementations_are_refused():
  inputs = make_inputs(12)
  shared = {**inputs, "tree_mask": inputs["tree_mask"][0]}
  per_row = {**inputs, "tree_mask": jnp.broadcast_to(inputs["tree_mask"][0], inputs["tree_mask"].shape)}
  assert_close(xla(**shared), reference(**per_row))
  with pytest.raises(ValueError, match=r"tree_attention: unknown implementation 'flash'"):
    tree_attention(**inputs, implementation="flash")
  with pytest.raises(ValueError, match=r"cache_attention: unknown implementation 'flash'"):
    cache_attention(inputs["q"], inputs["cache_k"], inputs["cache_v"], 3, implementation="flash")
  with pytest.raises(ValueError, match="cache_length must lie"):
    cache_attention(inputs["q"], inputs["cache_k"], inputs["cache_v"], 20)
