"""The split ("xla") path (`castle_jax.ops.tree_attention.xla`) against the reference, plain and
under jit with traced lengths and trees; poisoned empty cache slots; the LSE merge.
"""

from __future__ import annotations
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.tree_attention import (
  IMPLEMENTATIONS,
  tree_attention,
  tree_mask_from_parents,
)
from helpers import assert_close
from ops.tree_attention.base import (
  HAND_PARENTS,
  SPLIT_CONFIGS,
  TOLERANCE,
  chain_parents,
  jit_cache_attention,
  jit_masked_tree_attention,
  jit_merge,
  make_inputs,
  numpy_ancestors,
  random_parents,
  reference,
  upcast,
  xla,
)


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


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


# The kernels need head dims >= 16 (Mosaic: 64 or 128, 16-bit inputs): test_triton.py and
# test_mosaic.py poison their empty slots.
@pytest.mark.parametrize("implementation", [name for name in IMPLEMENTATIONS if name not in ("triton", "mosaic")])
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
