"""The oracle (`castle_jax.ops.tree_attention.reference`): dense tree attention and the cache part
against a float64 loop over the definition, an empty row included.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err
from ops.tree_attention.base import jit_cache_attention, make_inputs, numpy_tree_attention, reference


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


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
