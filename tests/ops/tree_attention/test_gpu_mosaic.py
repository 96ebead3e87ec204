"""The compiled Mosaic GPU tree attention kernel on a Hopper GPU at LLM sizes (skipped without a CUDA GPU).

Against the dense reference in float32 (itself checked against a float64 loop on CPU):
outputs and log-sum-exps for 32 query / 8 KV heads and 64 / 8 heads of 128 with a 69-node
tree over caches of 4K to 32K slots (capacities a multiple of 8 but not of the block, rows
full and partly filled), a decoding step (n = 1, empty tree) with empty, partial and full
rows, the cache part alone, float16 at head dim 64, and tilings next to the default one
(one and three consumer warpgroups, blocks of 128 keys, fixed splits); and the same inputs
through the Triton kernel, which the two must agree with.

    python -m pytest -q -p no:cacheprovider -m gpu tests/ops/tree_attention/test_gpu_mosaic.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.tree_attention import cache_attention, tree_attention, tree_attention_reference
from pallas_kernels.tree_attention import TreeAttentionMosaicConfig
from helpers import rel_err
from ops.tree_attention.base import full_random_inputs

pytestmark = pytest.mark.gpu

TOLERANCE = {jnp.float16: 5e-3, jnp.bfloat16: 1e-2}
# Capacities a multiple of 8 (the kernel needs it) and not of the 64- or 128-slot block.
HEADROOM = 264


def _expected(inputs, lengths):
  upcast = {k: v.astype(jnp.float32) if v.dtype != jnp.bool_ else v for k, v in inputs.items()}
  with jax.default_matmul_precision("highest"):
    return jax.jit(tree_attention_reference)(**upcast, cache_length=lengths)


def _assert_matches(out, lse, expected_out, expected_lse, dtype):
  assert out.dtype == dtype
  assert rel_err(out, expected_out) < TOLERANCE[dtype], rel_err(out, expected_out)
  finite = np.isfinite(np.asarray(expected_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  assert rel_err(np.asarray(lse)[finite], np.asarray(expected_lse)[finite]) < 1e-5


def _check(inputs, lengths, dtype, config=None):
  lengths = jnp.asarray(lengths, jnp.int32)
  run = functools.partial(tree_attention, implementation="mosaic", return_lse=True, kernel_config=config)
  out, lse = jax.jit(run)(**inputs, cache_length=lengths)
  expected_out, expected_lse = _expected(inputs, lengths)
  _assert_matches(out, lse, expected_out, expected_lse, dtype)
  return out, lse


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("length", [4096, 16384, 32768])
def test_llm_verification_shape(length, heads):
  capacity = length + HEADROOM
  inputs = full_random_inputs(
    0, batch=2, n=69, heads=heads, kv_heads=8, head_dim=128, capacity=capacity, dtype=jnp.bfloat16
  )
  lengths = [capacity, length // 2 + 37]
  out, lse = _check(inputs, lengths, jnp.bfloat16)
  triton = jax.jit(functools.partial(tree_attention, implementation="triton", return_lse=True))
  triton_out, triton_lse = triton(**inputs, cache_length=jnp.asarray(lengths, jnp.int32))
  assert rel_err(out, triton_out) < 1e-2
  assert rel_err(lse, triton_lse) < 1e-5


@pytest.mark.parametrize(
  "config",
  [
    TreeAttentionMosaicConfig(consumers=1),
    TreeAttentionMosaicConfig(consumers=3, stages=2),
    TreeAttentionMosaicConfig(block_keys=128, stages=2),
    TreeAttentionMosaicConfig(splits=7, stages=4),
  ],
  ids=["one consumer", "three consumers", "blocks of 128", "7 splits, 4 stages"],
)
def test_tilings(config):
  capacity = 16384 + HEADROOM
  inputs = full_random_inputs(
    1, batch=2, n=69, heads=32, kv_heads=8, head_dim=128, capacity=capacity, dtype=jnp.bfloat16
  )
  _check(inputs, [capacity, 9001], jnp.bfloat16, config)


def test_decoding_step_ragged_rows_and_cache_part():
  inputs = full_random_inputs(2, batch=3, n=1, heads=32, kv_heads=8, head_dim=128, capacity=5000, dtype=jnp.bfloat16)
  lengths = jnp.asarray([0, 4999, 37], jnp.int32)
  _check(inputs, lengths, jnp.bfloat16)
  args = (inputs["q"], inputs["cache_k"], inputs["cache_v"], lengths)
  out, lse = jax.jit(functools.partial(cache_attention, implementation="mosaic"))(*args)
  with jax.default_matmul_precision("highest"):
    expected_out, expected_lse = cache_attention(
      *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args), implementation="reference"
    )
  assert rel_err(out, expected_out) < TOLERANCE[jnp.bfloat16]
  np.testing.assert_array_equal(np.asarray(lse[0]), -np.inf)
  np.testing.assert_array_equal(np.asarray(out[0], np.float32), 0.0)
  assert rel_err(lse[1:], expected_lse[1:]) < 1e-5


def test_float16_at_head_dim_64():
  inputs = full_random_inputs(3, batch=1, n=69, heads=8, kv_heads=4, head_dim=64, capacity=8192, dtype=jnp.float16)
  _check(inputs, [8000], jnp.float16)
