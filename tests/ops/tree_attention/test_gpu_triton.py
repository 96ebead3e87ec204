"""The compiled hybrid tree attention kernel on the GPU at real sizes (skipped without a CUDA GPU).

Against the dense reference in float32 (itself checked against a float64 loop on CPU):
outputs and log-sum-exps for the LongSpec target's heads (8 query / 4 KV heads of 64)
at a 16K cache with a 69-node tree, a decoding step (n = 1, empty tree), per-row
lengths (empty, partial, full), plain heads of 128, float32 and bf16 inputs, and the
default tiling next to small and large ones.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.tree_attention import cache_attention, tree_attention, tree_attention_reference
from pallas_kernels.tree_attention import TreeAttentionTritonConfig
from helpers import rel_err
from ops.tree_attention.base import full_random_inputs

pytestmark = pytest.mark.gpu

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2}


def _check(inputs, lengths, dtype, config=None):
  lengths = jnp.asarray(lengths, jnp.int32)
  run = jax.jit(functools.partial(tree_attention, implementation="triton", return_lse=True, kernel_config=config))
  out, lse = run(**inputs, cache_length=lengths)
  upcast = {k: v.astype(jnp.float32) if v.dtype == dtype and v.dtype != jnp.bool_ else v for k, v in inputs.items()}
  with jax.default_matmul_precision("highest"):
    expected_out, expected_lse = jax.jit(tree_attention_reference)(**upcast, cache_length=lengths)
  assert out.dtype == dtype
  assert rel_err(out, expected_out) < TOLERANCE[dtype]
  finite = np.isfinite(np.asarray(expected_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  assert rel_err(np.asarray(lse)[finite], np.asarray(expected_lse)[finite]) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
  "config",
  [
    None,
    TreeAttentionTritonConfig(block_rows=32, block_keys=32),
    TreeAttentionTritonConfig(block_rows=128, block_keys=128, splits=7),
  ],
  ids=["default", "small", "large"],
)
def test_target_verification_shape(dtype, config):
  inputs = full_random_inputs(0, batch=2, n=69, heads=8, kv_heads=4, head_dim=64, capacity=16384 + 300, dtype=dtype)
  _check(inputs, [16384 + 300, 9000], dtype, config)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decoding_step_and_ragged_rows(dtype):
  inputs = full_random_inputs(1, batch=3, n=1, heads=8, kv_heads=4, head_dim=64, capacity=5000, dtype=dtype)
  lengths = jnp.asarray([0, 4999, 37], jnp.int32)
  _check(inputs, lengths, dtype)
  out, lse = jax.jit(functools.partial(cache_attention, implementation="triton"))(
    inputs["q"], inputs["cache_k"], inputs["cache_v"], lengths
  )
  with jax.default_matmul_precision("highest"):
    expected_out, expected_lse = cache_attention(
      inputs["q"], inputs["cache_k"], inputs["cache_v"], lengths, implementation="reference"
    )
  assert rel_err(out, expected_out) < TOLERANCE[dtype]
  np.testing.assert_array_equal(np.asarray(lse[0]), -np.inf)


def test_plain_heads_of_128():
  inputs = full_random_inputs(2, batch=1, n=40, heads=4, kv_heads=4, head_dim=128, capacity=3000, dtype=jnp.bfloat16)
  _check(inputs, [2999], jnp.bfloat16)
