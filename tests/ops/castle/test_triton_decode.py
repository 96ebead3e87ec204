"""The fused CASTLE decoding kernel (pallas_kernels.castle.triton_decode) in interpret mode.

Each step's output is checked against the parallel form's row and the cache's
lookahead keys against U^t from the definition, for CASTLE (update fused into the
kernel) and CASTLE-SWL (update in XLA, kernel attends), with several splits per head
(some of them without rows early on), a capacity that is not a multiple of the
block, NaN in the slots not yet written, a full cache, and bad input.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import append_tokens, castle_parallel, decode_step, init_cache, lookahead_keys, prefill
from helpers import rel_err
from pallas_kernels.castle import CastleDecodeConfig
from pallas_kernels.castle import triton_decode as pallas_decode

SHAPE = (2, 40, 3, 16)  # batch, seq, heads, head_dim
CAPACITY = 43  # not a multiple of the 16-row blocks
CONFIG = CastleDecodeConfig(block_rows=16, splits=3)


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _inputs(seed, shape=SHAPE, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 6)
  return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys)


def _pallas_step(config=CONFIG):
  return jax.jit(lambda cache, *token: decode_step(cache, *token, implementation="triton", kernel_config=config))


@pytest.mark.parametrize("window", [None, 5])
def test_decoding_matches_parallel_form_and_definition(window):
  inputs = _inputs(seed=1 + (window or 0))
  batch, seq, heads, head_dim = SHAPE
  expected = castle_parallel(*inputs, window=window)
  cache = init_cache(batch, CAPACITY, heads, head_dim, jnp.float32, window=window)
  prompt = 3
  _, cache = prefill(cache, *(x[:, :prompt] for x in inputs))
  step = _pallas_step()
  for t in range(prompt, seq):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    assert int(cache.length) == t + 1
    assert rel_err(out, expected[:, t : t + 1]) < 1e-5, t
    if t % 9 == 0 or t == seq - 1:
      keys = lookahead_keys(*inputs[:3], t + 1, window=window)
      assert rel_err(cache.lookahead_keys[:, : t + 1], keys) < 1e-5, t
  assert np.all(np.asarray(cache.lookahead_keys[:, seq:]) == 0)


def test_decoding_from_an_empty_cache_and_one_split():
  """Step 0 attends to its own row only; one program per head sweeps every block."""
  inputs = _inputs(seed=3)
  batch, seq, heads, head_dim = SHAPE
  expected = castle_parallel(*inputs)
  cache = init_cache(batch, CAPACITY, heads, head_dim, jnp.float32)
  step = _pallas_step(CastleDecodeConfig(block_rows=16, splits=1))
  for t in range(20):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    assert rel_err(out, expected[:, t : t + 1]) < 1e-5, t


def test_kernel_agrees_with_xla_step_in_bf16():
  inputs = _inputs(seed=4, dtype=jnp.bfloat16)
  batch, seq, heads, head_dim = SHAPE
  cache = init_cache(batch, CAPACITY, heads, head_dim, jnp.bfloat16)
  _, cache = prefill(cache, *(x[:, :30] for x in inputs))
  token = tuple(x[:, 30:31] for x in inputs)
  out, after = _pallas_step()(cache, *token)
  out_xla, after_xla = jax.jit(lambda c, *a: decode_step(c, *a, implementation="xla"))(cache, *token)
  assert out.dtype == jnp.bfloat16 and after.lookahead_keys.dtype == jnp.bfloat16
  assert rel_err(out.astype(jnp.float32), out_xla.astype(jnp.float32)) < 1e-2
  # Both round the same float32 update to bf16; only summation order differs.
  assert rel_err(after.lookahead_keys.astype(jnp.float32), after_xla.lookahead_keys.astype(jnp.float32)) < 1e-2
  assert rel_err(after.lookahead_keys.astype(jnp.float32), cache.lookahead_keys.astype(jnp.float32)) > 1e-3


def test_decoding_ignores_poisoned_empty_slots():
  inputs = _inputs(seed=5)
  batch, seq, heads, head_dim = SHAPE
  cache = init_cache(batch, CAPACITY, heads, head_dim, jnp.float32)
  prompt = 20
  _, cache = prefill(cache, *(x[:, :prompt] for x in inputs))
  empty = (jnp.arange(CAPACITY) >= prompt)[None, :, None, None]
  cache = cache.replace(
    **{
      name: jnp.where(empty, jnp.nan, getattr(cache, name))
      for name in ("lookahead_keys", "lookahead_queries", "causal_keys", "causal_values")
    }
  )
  expected = castle_parallel(*inputs)
  out, cache = _pallas_step()(cache, *(x[:, prompt : prompt + 1] for x in inputs))
  assert rel_err(out, expected[:, prompt : prompt + 1]) < 1e-5
  assert np.all(np.isfinite(np.asarray(cache.lookahead_keys[:, : prompt + 1])))


def test_append_tokens_passes_the_implementation_on():
  inputs = _inputs(seed=6)
  batch, seq, heads, head_dim = SHAPE
  cache = init_cache(batch, CAPACITY, heads, head_dim, jnp.float32)
  _, cache = prefill(cache, *(x[:, :10] for x in inputs))
  text = str(
    jax.make_jaxpr(lambda c, *a: append_tokens(c, *a, implementation="triton"))(cache, *(x[:, 10:12] for x in inputs))
  )
  assert "castle_decode" in text
  out, cache = append_tokens(cache, *(x[:, 10:12] for x in inputs), implementation="triton")
  assert rel_err(out, castle_parallel(*inputs)[:, 10:12]) < 1e-5


def test_full_cache_leaves_everything_unchanged():
  inputs = _inputs(seed=7, shape=(1, 5, 2, 16))
  cache = init_cache(1, 4, 2, 16, jnp.float32)
  _, full = prefill(cache, *(x[:, :4] for x in inputs))
  out, after = _pallas_step(CastleDecodeConfig(block_rows=16, splits=2))(full, *(x[:, 4:5] for x in inputs))
  assert np.all(np.isnan(np.asarray(out)))
  assert int(after.length) == 4
  for name in ("lookahead_keys", "lookahead_queries", "causal_keys", "causal_values"):
    np.testing.assert_array_equal(getattr(after, name), getattr(full, name))


def test_default_splits_fill_the_gpu_but_keep_blocks_per_split():
  assert pallas_decode.default_splits(batch_heads=576, capacity=16384, block_rows=32) == 8
  assert pallas_decode.default_splits(batch_heads=9, capacity=16384, block_rows=64) == 64
  assert pallas_decode.default_splits(batch_heads=1, capacity=100, block_rows=64) == 1


def test_bad_input():
  inputs = _inputs(seed=8, shape=(1, 2, 2, 24))
  cache = init_cache(1, 4, 2, 24, jnp.float32)
  with pytest.raises(ValueError, match="power-of-two head dims"):
    decode_step(cache, *(x[:, :1] for x in inputs), implementation="triton")
  # Unset, the same head dim runs the XLA step on a GPU; on CPU it is XLA anyway.
  out, _ = decode_step(cache, *(x[:, :1] for x in inputs))
  assert out.shape == (1, 1, 2, 24)
  with pytest.raises(ValueError, match="CastleDecodeConfig.block_rows"):
    CastleDecodeConfig(block_rows=48)
  with pytest.raises(ValueError, match="CastleDecodeConfig.splits"):
    CastleDecodeConfig(splits=0)
  with pytest.raises(ValueError, match="implementation"):
    decode_step(cache, *(x[:, :1] for x in inputs), implementation="cuda")
  assert dataclasses.asdict(CastleDecodeConfig())["splits"] is None
