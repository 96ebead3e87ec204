"""The hybrid tree attention kernel (`pallas_kernels/tree_attention`) in interpret mode on CPU.

Against the dense reference (itself checked against a float64 loop in
test_xla.py): outputs and log-sum-exps with grouped and plain heads, one node
and many, several row blocks and splits, empty, partial and full caches per row, under
jit with traced lengths and trees; poisoned empty slots; the cache part alone; the
default choice on a GPU; config checks; and a lowering for an H100 (which catches the
Triton backend's shape limits without a GPU).
"""

from __future__ import annotations

import functools
import logging

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from castle_jax.ops.tree_attention import cache_attention, tree_attention, tree_attention_reference
from pallas_kernels.tree_attention import TreeAttentionTritonConfig, tree_attention_triton
from helpers import assert_close
from ops.tree_attention.base import jitted_kernel, make_inputs, upcast

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# Small tiles so that few slots already make several key blocks, splits and row blocks.
SMALL_TILES = TreeAttentionTritonConfig(block_rows=16, block_keys=16, splits=3)
reference = jax.jit(tree_attention_reference)


pallas = jitted_kernel("triton", SMALL_TILES)


CONFIGS = [
  dict(),  # 6 nodes x 2 heads per KV head: one row block
  dict(n=1, cache_length=0),  # a decoding step on an empty cache
  dict(n=1, cache_length=[40, 17], heads=2, kv_heads=2),  # a decoding step, plain heads
  dict(cache_length=[0, 40], tree="chain"),  # empty and full rows
  dict(n=20, heads=4, kv_heads=1, cache_length=[33, 7]),  # 80 rows: 5 row blocks
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("config", CONFIGS)
def test_kernel_matches_reference(config, dtype):
  inputs = make_inputs(11, head_dim=16, capacity=40, dtype=dtype, **{"cache_length": 37, **config})
  out, lse = pallas(**inputs)
  chex.assert_type(out, dtype)
  chex.assert_type(lse, jnp.float32)
  assert_close((out, lse), reference(**upcast(inputs)), tol=TOLERANCE[dtype])


def test_default_tiles_and_one_compiled_function_for_traced_lengths_and_trees():
  inputs = make_inputs(12, head_dim=16, capacity=300, n=9, cache_length=[300, 0])
  # A kernel call first: the first one in a process imports jax's Pallas interpret modules,
  # one of which adds a flag to jax's tracing context, which would retrace `verify` once.
  tree_attention(**inputs, implementation="triton")
  traces = []

  @jax.jit
  def verify(cache_length, tree_mask):
    traces.append(1)
    return tree_attention(
      **{**inputs, "cache_length": cache_length, "tree_mask": tree_mask}, implementation="triton", return_lse=True
    )

  rng = np.random.default_rng(12)
  for lengths in ([300, 0], [129, 64], [1, 299]):
    mask = np.tril(rng.random((2, 9, 9)) < 0.5) | np.eye(9, dtype=bool)
    inputs_now = {**inputs, "cache_length": jnp.asarray(lengths, jnp.int32), "tree_mask": jnp.asarray(mask)}
    assert_close(verify(inputs_now["cache_length"], inputs_now["tree_mask"]), reference(**inputs_now))
  assert len(traces) == 1


def test_slots_past_the_length_are_never_read():
  """NaN and huge values past each row's length: the outputs equal those of a clean cache."""
  inputs = make_inputs(13, head_dim=16, capacity=40, cache_length=[5, 18])
  beyond = (np.arange(40)[None, :] >= np.array([5, 18])[:, None])[:, :, None, None]
  poisoned = {
    **inputs,
    "cache_k": jnp.where(beyond, jnp.nan, inputs["cache_k"]),
    "cache_v": jnp.where(beyond, 1e30, inputs["cache_v"]),
  }
  out, lse = pallas(**poisoned)
  assert np.isfinite(np.asarray(out)).all()
  assert_close((out, lse), reference(**inputs))


def test_cache_part_alone_matches_reference():
  inputs = make_inputs(14, head_dim=16, capacity=40, n=3, cache_length=[0, 29])
  args = [inputs[name] for name in ("q", "cache_k", "cache_v", "cache_length")]
  run = jax.jit(cache_attention, static_argnames=("implementation", "kernel_config"))
  out, lse = run(*args, implementation="triton", kernel_config=SMALL_TILES)
  expected_out, expected_lse = run(*args, implementation="reference")
  assert_close(out, expected_out)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(expected_lse), rtol=1e-6)  # -inf where empty
  np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
  np.testing.assert_array_equal(np.asarray(lse[0]), -np.inf)


def test_default_is_the_kernel_on_a_gpu_where_it_takes_the_head_dim(monkeypatch, caplog):
  """The choice, made while tracing: eval_shape never lowers, so no GPU is needed."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    jax.eval_shape(tree_attention, **make_inputs(15, head_dim=16))
    assert "tree_attention: implementation=None -> 'triton'" in caplog.text
    caplog.clear()
    jax.eval_shape(tree_attention, **make_inputs(15, head_dim=24))
    assert "-> 'xla' (skipped mosaic: " in caplog.text
    assert "; triton: the kernel needs a power-of-two head_dim >= 16, got 24" in caplog.text


def test_explicit_pallas_with_an_unsupported_head_dim_names_the_fix():
  with pytest.raises(
    ValueError,
    match=r"implementation='triton' cannot run: .*head_dim >= 16, got 8 "
    r"\(use implementation='xla'\)",
  ):
    tree_attention(**make_inputs(16, head_dim=8), implementation="triton")


@pytest.mark.parametrize(
  "fields, match",
  [
    (dict(block_keys=24), r"TreeAttentionTritonConfig.block_keys must be a power of two, got 24"),
    (dict(block_rows=8), r"TreeAttentionTritonConfig.block_rows must be >= 16"),
    (dict(splits=0), r"TreeAttentionTritonConfig.splits must be an int >= 1, got 0"),
  ],
)
def test_config_checks_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    TreeAttentionTritonConfig(**fields)
  assert TreeAttentionTritonConfig.from_string("block_keys=32,splits=none") == TreeAttentionTritonConfig(block_keys=32)


@pytest.mark.parametrize("n, dtype", [(69, jnp.bfloat16), (1, jnp.float32)])
def test_lowers_for_an_h100(n, dtype):
  """The target's verification shape (8 query / 4 KV heads of 64, 16K cache) and a
  decoding step, lowered to the Triton backend for an H100 on this CPU."""
  shape = jax.ShapeDtypeStruct
  capacity = 16384 + 300
  args = dict(
    q=shape((1, n, 8, 64), dtype),
    cache_k=shape((1, capacity, 4, 64), dtype),
    cache_v=shape((1, capacity, 4, 64), dtype),
    cache_length=shape((), jnp.int32),
    tree_k=shape((1, n, 4, 64), dtype),
    tree_v=shape((1, n, 4, 64), dtype),
    tree_mask=shape((n, n), jnp.bool_),
  )
  run = functools.partial(tree_attention_triton, interpret=False)  # the entry point interprets on CPU
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100 80GB HBM3", None, "cuda"))
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(run).trace(**args).lower(lowering_platforms=("cuda",))
  assert "tree_attention" in lowered.as_text()
