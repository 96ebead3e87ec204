"""The public ops `tree_attention` and `cache_attention`: the default implementation (XLA on a
CPU, logged), bad input named by its argument, a mask shared by the batch, unknown implementations.
"""

from __future__ import annotations
import logging

import chex
import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.tree_attention import (
  cache_attention,
  tree_attention,
)
from helpers import assert_close
from ops.tree_attention.base import _replace, make_inputs, reference, xla


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def test_default_is_xla_and_logged(caplog):
  inputs = make_inputs(10)
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    out = jax.jit(tree_attention)(**inputs)  # the choice is made (and logged) while tracing
  assert "tree_attention: implementation=None -> 'xla'" in caplog.text
  chex.assert_shape(out, inputs["q"].shape)
  assert_close(out, reference(**inputs)[0])


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
