"""The public ops `tree_attention` and `cache_attention`: the default implementation (XLA on a
CPU, logged; with the device faked, "mosaic" on a Hopper GPU where it measured faster, else
"triton"), an explicit "mosaic" off Hopper refused naming why, bad input named by its argument,
a mask shared by the batch, unknown implementations.
"""

from __future__ import annotations
import logging

import chex
import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops import backend
from castle_jax.ops.tree_attention import (
  api,
  cache_attention,
  tree_attention,
)
from helpers import AMPERE, HOPPER, assert_close
from ops.tree_attention.base import _replace, make_inputs, reference, xla


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def test_default_is_xla_and_logged(caplog):
  inputs = make_inputs(10)
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    out = jax.jit(tree_attention)(**inputs)  # the choice is made (and logged) while tracing
  assert "tree_attention: implementation=None -> 'xla'" in caplog.text
  chex.assert_shape(out, inputs["q"].shape)
  assert_close(out, reference(**inputs)[0])


def _choose(requested=None, heads=32, kv_heads=8, head_dim=128, dtype=jnp.bfloat16, tree=True, capacity=4096, nodes=69):
  """The implementation the op would pick for inputs of these shapes (a tree of `nodes`, or the
  cache part alone)."""
  n = nodes if tree else 1
  q = jax.ShapeDtypeStruct((1, n, heads, head_dim), dtype)
  cache = jax.ShapeDtypeStruct((1, capacity, kv_heads, head_dim), dtype)
  nodes = jax.ShapeDtypeStruct((1, n, kv_heads, head_dim), dtype)
  kv_arrays = (cache, cache, nodes, nodes) if tree else (cache, cache)
  table = api._implementations(q, kv_arrays, None)
  return backend.choose("tree_attention", requested, table, api._DEFAULT_ORDER)


def test_the_default_on_hopper_takes_mosaic_where_it_measured_faster(device):
  device(HOPPER)
  assert _choose() == "mosaic"  # LLM heads verifying a tree
  assert _choose(heads=64) == "mosaic"
  assert _choose(heads=8, kv_heads=4, head_dim=64) == "triton"  # measured no faster at 4K-16K
  assert _choose(heads=8, kv_heads=4, head_dim=64, capacity=32768) == "mosaic"  # faster from 32K
  assert _choose(tree=False) == "triton"  # the cache part alone: a decoding step
  assert _choose(nodes=6) == "triton"  # a chain's few nodes: not measured
  assert _choose(nodes=64) == "mosaic"
  assert _choose(dtype=jnp.float16) == "triton"  # not measured
  assert _choose(capacity=4100) == "triton"  # a capacity the kernel cannot take
  assert _choose(dtype=jnp.float32) == "triton"
  assert _choose("triton") == "triton"  # an explicit choice is not overridden


def test_off_hopper_the_default_is_triton_and_mosaic_is_refused(device):
  for capability in (AMPERE, "10.0"):
    device(capability)
    assert _choose() == "triton", capability
    with pytest.raises(ValueError, match=r"need a Hopper GPU \(compute capability 9.x\).*implementation='triton'"):
      _choose("mosaic")


def test_the_default_logs_once_why_it_passes_over_mosaic(device, caplog):
  device(HOPPER)
  backend.log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger=backend.__name__):
    for _ in range(2):
      _choose(tree=False)
  messages = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
  assert len(messages) == 1 and "the cache part alone" in messages[0], messages


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
