"""The Mosaic GPU tree attention kernel (`pallas_kernels/tree_attention/mosaic.py`) on CPU: GPU
interpret mode runs the same kernel code (TMA copies, barriers, wgmma), and the Mosaic lowering
for an H100 runs on CPU too.

Against the dense reference in float32 (itself checked against a float64 loop in test_xla.py):
outputs and log-sum-exps for the shared cases of base.py (grouped and plain heads, one node,
empty, partial and full caches per row, a cache under one block), and for several splits, key
blocks and row groups: lengths not a multiple of the block, a last block past a capacity that
is not a multiple of it, 1 to 3 consumer warpgroups, blocks of 128 keys; under jit with traced
lengths and trees; poisoned empty slots; the cache part alone; float16. The default choice never
takes the kernel; inputs it cannot take get one line naming the argument and the fix. The
lowering test covers the GPU variant of the two places where interpret mode differs (module
docstring of the kernel) at the LLM shapes, and the shared memory it allocates.
"""

from __future__ import annotations

import functools
import logging

import chex
import jax
from jax._src.pallas.mosaic_gpu import lowering as mosaic_lowering
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.tree_attention import cache_attention, tree_attention, tree_attention_reference
from helpers import assert_close, lowered_for_h100
from ops.tree_attention.base import SPLIT_CONFIGS, jitted_kernel, make_inputs, upcast
from pallas_kernels.tree_attention import TreeAttentionMosaicConfig, tree_attention_mosaic
from pallas_kernels.tree_attention.mosaic import SHARED_MEMORY_LIMIT, default_config, shared_memory_bytes

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

TOLERANCE = {jnp.bfloat16: 1e-2, jnp.float16: 5e-3}
# Small splits so that a few hundred slots already make several splits of several blocks.
SMALL_SPLITS = TreeAttentionMosaicConfig(splits=3)
reference = jax.jit(tree_attention_reference)
H100_SHARED_MEMORY = 227 * 1024


mosaic = jitted_kernel("mosaic")


def _check(inputs, config=None, dtype=jnp.bfloat16):
  out, lse = mosaic(**inputs, config=config)
  chex.assert_type(out, dtype)
  chex.assert_type(lse, jnp.float32)
  expected_out, expected_lse = reference(**upcast(inputs))
  assert_close(out.astype(jnp.float32), expected_out, TOLERANCE[dtype])
  # -inf where a row sees nothing: same places, finite values close.
  finite = np.isfinite(np.asarray(expected_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  assert_close(np.asarray(lse)[finite], np.asarray(expected_lse)[finite], 1e-5)


@pytest.mark.parametrize("case", range(len(SPLIT_CONFIGS)))
def test_shared_cases_match_reference(case):
  """base.py's cases at head dim 64 (capacities 11 and 13: a cache under one block)."""
  _check(make_inputs(30 + case, **{**SPLIT_CONFIGS[case], "head_dim": 64}, dtype=jnp.bfloat16))


CASES = {
  # 6 nodes x 2 heads per KV head, lengths not a multiple of the 64-slot block; the last
  # block of the 37-slot row and the 130-slot row's third block are partial.
  "partial blocks": (dict(cache_length=[130, 37]), SMALL_SPLITS),
  # 200 slots: the last block of a full row runs past the capacity and is loaded ending there.
  "full and empty rows": (dict(cache_length=[200, 0], tree="chain"), SMALL_SPLITS),
  # 4 query heads per KV head, 20 nodes: 80 rows, 2 tiles in 2 row groups of one consumer.
  "grouped heads, one consumer": (
    dict(n=20, heads=8, kv_heads=2, cache_length=[129, 64]),
    TreeAttentionMosaicConfig(consumers=1, splits=2),
  ),
  # The same rows in one program of three consumers, one of them on padding rows only.
  "grouped heads, three consumers": (
    dict(n=20, heads=8, kv_heads=2, cache_length=[129, 64]),
    TreeAttentionMosaicConfig(consumers=3, stages=2, splits=2),
  ),
  # 8 query heads per KV head, 20 nodes: 160 rows, 3 tiles in 2 row groups of two consumers,
  # the second consumer of the last group idle (padding rows only).
  "an idle consumer in the last row group": (
    dict(n=20, heads=16, kv_heads=2, cache_length=[129, 64]),
    TreeAttentionMosaicConfig(consumers=2, splits=2),
  ),
  # A tree of 70 nodes: two tree blocks of 64 keys, or one of 128.
  "two tree blocks": (dict(n=70, heads=2, kv_heads=1, cache_length=[200, 5]), TreeAttentionMosaicConfig(splits=2)),
  "blocks of 128": (
    dict(n=70, heads=2, kv_heads=1, cache_length=[200, 5]),
    TreeAttentionMosaicConfig(block_keys=128, splits=2),
  ),
  # A decoding step: n = 1, plain heads, batch 3, a default tiling.
  "decoding step": (dict(n=1, heads=2, kv_heads=2, cache_length=[1, 200, 77], batch=3), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case):
  shape, config = CASES[case]
  _check(make_inputs(40, **{"head_dim": 64, "capacity": 200, "dtype": jnp.bfloat16, **shape}), config)


def test_float16_and_head_dim_128():
  inputs = make_inputs(41, head_dim=128, capacity=136, n=5, heads=4, kv_heads=1, cache_length=[100, 136])
  inputs = {name: x.astype(jnp.float16) if x.dtype == jnp.float32 else x for name, x in inputs.items()}
  _check(inputs, SMALL_SPLITS, jnp.float16)


def test_one_compiled_function_for_traced_lengths_and_trees():
  inputs = make_inputs(42, head_dim=64, capacity=160, n=9, cache_length=[160, 0], dtype=jnp.bfloat16)
  traces = []

  @jax.jit
  def verify(cache_length, tree_mask):
    traces.append(1)
    return tree_attention(
      **{**inputs, "cache_length": cache_length, "tree_mask": tree_mask},
      implementation="mosaic",
      return_lse=True,
      kernel_config=SMALL_SPLITS,
    )

  rng = np.random.default_rng(42)
  for lengths in ([160, 0], [65, 64], [1, 159]):
    mask = np.tril(rng.random((2, 9, 9)) < 0.5) | np.eye(9, dtype=bool)
    now = {**inputs, "cache_length": jnp.asarray(lengths, jnp.int32), "tree_mask": jnp.asarray(mask)}
    out, lse = verify(now["cache_length"], now["tree_mask"])
    expected_out, expected_lse = reference(**upcast(now))
    assert_close((out.astype(jnp.float32), lse), (expected_out, expected_lse), 1e-2)
  assert len(traces) == 1


def test_slots_past_the_length_do_not_leak():
  """NaN keys and huge values past each row's length (inside the last loaded block and
  beyond it): the outputs equal those of a clean cache."""
  inputs = make_inputs(43, head_dim=64, capacity=200, cache_length=[5, 130], dtype=jnp.bfloat16)
  beyond = (np.arange(200)[None, :] >= np.array([5, 130])[:, None])[:, :, None, None]
  poisoned = {
    **inputs,
    "cache_k": jnp.where(beyond, jnp.nan, inputs["cache_k"]),
    "cache_v": jnp.where(beyond, 1e30, inputs["cache_v"]),
  }
  out, lse = mosaic(**poisoned, config=SMALL_SPLITS)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  expected_out, expected_lse = reference(**upcast(inputs))
  assert_close((out.astype(jnp.float32), lse), (expected_out, expected_lse), 1e-2)


def test_cache_part_alone_matches_reference():
  inputs = make_inputs(44, head_dim=64, capacity=200, n=3, heads=8, kv_heads=2, cache_length=[0, 131])
  inputs = {name: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for name, x in inputs.items()}
  args = [inputs[name] for name in ("q", "cache_k", "cache_v", "cache_length")]
  run = jax.jit(cache_attention, static_argnames=("implementation", "kernel_config"))
  out, lse = run(*args, implementation="mosaic", kernel_config=SMALL_SPLITS)
  expected_out, expected_lse = run(*[x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args])
  assert_close(out.astype(jnp.float32), expected_out.astype(jnp.float32), 1e-2)
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(lse[0]), -np.inf)
  assert_close(lse[1], expected_lse[1], 1e-5)


def test_default_never_takes_the_kernel(monkeypatch, caplog):
  """Not yet timed: on a GPU the default stays "triton" for inputs the Mosaic kernel takes."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    jax.eval_shape(tree_attention, **make_inputs(45, head_dim=64, capacity=64, dtype=jnp.bfloat16))
  assert "tree_attention: implementation=None -> 'triton'" in caplog.text


def _bf16(inputs):
  return {name: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for name, x in inputs.items()}


@pytest.mark.parametrize(
  "inputs, config, match",
  [
    (
      make_inputs(46, head_dim=64),
      None,
      r"implementation='mosaic' cannot run: the Mosaic kernel takes q in \['bfloat16', 'float16'\] \(wgmma's "
      r"16-bit operands\), got dtype float32; cast q and the keys and values, or use implementation='triton'\.",
    ),
    (
      _bf16(make_inputs(46, head_dim=32)),
      None,
      r"cannot run: the Mosaic kernel takes head_dim in \(64, 128\) \(last axis of q\), got 32; "
      r"use implementation='triton'\.",
    ),
    (
      _bf16(make_inputs(46, head_dim=64, capacity=100, cache_length=50)),
      None,
      r"cannot run: the Mosaic kernel needs a cache capacity \(axis 1 of cache_k\) that is a multiple of 8 "
      r"\(TMA copies of 8-row tiles\), got 100; allocate the cache with its capacity rounded up to a multiple "
      r"of 8, or use implementation='triton'\.",
    ),
    (
      {**_bf16(make_inputs(46, head_dim=64)), "cache_v": make_inputs(46, head_dim=64)["cache_v"]},
      None,
      r"cannot run: the Mosaic kernel takes cache_k, cache_v, tree_k and tree_v in q's dtype bfloat16, got "
      r"\['float32'\]; cast them or use implementation='triton'\.",
    ),
    (
      _bf16(make_inputs(46, head_dim=128, n=300, heads=1, kv_heads=1)),
      TreeAttentionMosaicConfig(block_keys=128, stages=4, consumers=3),
      r"cannot run: the Mosaic kernel's buffers for n=300 tree nodes and head_dim=128 take \d+ bytes of "
      r"shared memory, over 231424; use fewer stages or consumers in TreeAttentionMosaicConfig, or "
      r"implementation='triton'\.",
    ),
  ],
  ids=["float32", "head dim 32", "capacity 100", "mixed dtypes", "shared memory"],
)
def test_inputs_the_kernel_cannot_take_name_the_fix(inputs, config, match):
  with pytest.raises(ValueError, match=match):
    tree_attention(**inputs, implementation="mosaic", kernel_config=config)


@pytest.mark.parametrize(
  "fields, match",
  [
    (
      dict(block_keys=32),
      r"TreeAttentionMosaicConfig.block_keys must be 64 or 128 \(the score wgmma's N side\), got 32",
    ),
    (dict(stages=1), r"TreeAttentionMosaicConfig.stages must be >= 2"),
    (dict(consumers=4), r"TreeAttentionMosaicConfig.consumers must be 1, 2 or 3 .*got 4"),
    (dict(splits=0), r"TreeAttentionMosaicConfig.splits must be an int >= 1, got 0"),
  ],
)
def test_config_checks_name_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    TreeAttentionMosaicConfig(**fields)
  assert TreeAttentionMosaicConfig.from_string("block_keys=128,splits=none") == TreeAttentionMosaicConfig(
    block_keys=128
  )


@pytest.mark.parametrize(
  "n, heads, kv_heads, config, with_tree",
  [
    (69, 32, 8, None, True),
    (69, 32, 8, TreeAttentionMosaicConfig(), True),
    (69, 64, 8, TreeAttentionMosaicConfig(consumers=3, stages=2), True),
    (69, 32, 8, TreeAttentionMosaicConfig(consumers=3, stages=2), True),
    (1, 32, 8, None, False),
  ],
  ids=[
    "32/8 heads, default (blocks of 128)",
    "32/8 heads, 2 consumers",
    "64/8 heads, 3 consumers",
    "32/8 heads, 3 consumers",
    "cache part, n=1",
  ],
)
def test_lowers_for_an_h100(n, heads, kv_heads, config, with_tree, monkeypatch):
  """The LLM verification shapes (head dim 128, a 16K cache whose capacity is not a multiple
  of the block) lowered by Mosaic GPU for an H100 on this CPU, within its shared memory."""
  allocations = []
  estimate = mosaic_lowering._estimate_resources

  def recording(*args, **kwargs):
    resources = estimate(*args, **kwargs)
    allocations.append(resources.smem_scratch_bytes)
    return resources

  monkeypatch.setattr(mosaic_lowering, "_estimate_resources", recording)
  shape, dtype, capacity = jax.ShapeDtypeStruct, jnp.bfloat16, 16384 + 264
  args = [
    shape((1, n, heads, 128), dtype),
    shape((1, capacity, kv_heads, 128), dtype),
    shape((1, capacity, kv_heads, 128), dtype),
    shape((), jnp.int32),
  ]
  if with_tree:
    args += [shape((1, n, kv_heads, 128), dtype), shape((1, n, kv_heads, 128), dtype), shape((n, n), jnp.bool_)]
  text = lowered_for_h100(functools.partial(tree_attention_mosaic, config=config), args)
  assert text.count("custom_call @mosaic_gpu") == 1
  assert 0 < allocations[-1] <= H100_SHARED_MEMORY
  # The kernel's own estimate (which its check compares with the limit) is within alignment.
  tree_nodes = n if with_tree else 0
  config = config or default_config(
    head_dim=128, heads_per_kv_head=heads // kv_heads, tree_nodes=tree_nodes, dtype=dtype, batch_kv_heads=kv_heads
  )
  assert allocations[-1] - shared_memory_bytes(128, tree_nodes, dtype, config) <= 1024


@pytest.mark.parametrize(
  "n, group, head_dim, expected",
  [
    # Llama-3-8B: 276 rows, 5 tiles: 3 row groups of two consumers against 2 of three.
    (69, 4, 128, TreeAttentionMosaicConfig(block_keys=128, consumers=2, stages=2)),
    (69, 8, 128, TreeAttentionMosaicConfig(consumers=3, stages=2)),  # 9 tiles: 5 row groups against 3
    (69, 2, 64, TreeAttentionMosaicConfig(consumers=3, stages=2)),  # heads of 64: three
    (32, 4, 128, TreeAttentionMosaicConfig()),  # 128 rows: two tiles, a third consumer would idle
    (1, 4, 128, TreeAttentionMosaicConfig()),  # the cache part alone
    (300, 4, 128, TreeAttentionMosaicConfig()),  # five tree blocks of mask bias: three do not fit
  ],
  ids=["32/8 heads", "64/8 heads", "heads of 64", "two tiles", "cache part", "large tree"],
)
def test_default_config_takes_three_consumers_where_they_fill_and_fit(n, group, head_dim, expected):
  config = default_config(
    head_dim=head_dim, heads_per_kv_head=group, tree_nodes=n, dtype=jnp.bfloat16, batch_kv_heads=8
  )
  assert config == expected
  assert shared_memory_bytes(head_dim, n, jnp.bfloat16, config) <= SHARED_MEMORY_LIMIT


def test_default_config_keeps_three_consumers_where_two_would_get_few_splits():
  """32/8 heads x 69 nodes: two consumers need 3 row groups; at batch 4 (32 KV heads in all) they
  would get 1 split each, so three consumers (2 row groups, 2 splits) stay."""
  llama = dict(head_dim=128, heads_per_kv_head=4, tree_nodes=69, dtype=jnp.bfloat16)
  assert default_config(**llama, batch_kv_heads=8).consumers == 2
  assert default_config(**llama, batch_kv_heads=16) == TreeAttentionMosaicConfig(consumers=3, stages=2)
  assert default_config(**llama, batch_kv_heads=32) == TreeAttentionMosaicConfig(consumers=3, stages=2)


@pytest.mark.slow
def test_llm_heads_in_interpret_mode():
  """32 query / 8 KV heads of 128 and a 69-node tree (276 rows per KV head: 3 row groups of
  2 tiles) over a 264-slot cache, with the default tiling."""
  inputs = make_inputs(47, batch=1, n=69, heads=32, kv_heads=8, head_dim=128, capacity=264, cache_length=[250])
  _check(_bf16(inputs))
