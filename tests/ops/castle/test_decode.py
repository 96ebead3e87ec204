"""UQ-KV cache decoding (`castle_jax.ops.castle.decode`): token by token from an empty cache
against the recurrent definition (outputs and the cache's U against U^t from Eq. 2), with and
without jit; prefill then decode against the parallel form, poisoned empty slots, bf16, and a
full cache.
"""

from absl.testing import parameterized
import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import decode_step, init_cache, lookahead_keys, prefill
from helpers import rel_err
from ops.castle.base import SHAPE, math_inputs, parallel, recurrent


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


class DecodeFromEmptyCacheTest(chex.TestCase):
  """Token-by-token decoding: outputs vs the recurrent form, cache U vs U^t from Eq. (2);
  with and without jit (chex variants), since the step checks a concrete cache length
  eagerly and a traced one under jit."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(None, 1, 3)  # window > capacity: see the prefill test.
  def test_matches_definition(self, window):
    with jax.enable_x64(True):
      inputs = math_inputs(seed=50 + (window or 0), dtype=jnp.float64)
      seq = SHAPE[1]
      expected = recurrent(inputs, window)
      cache = init_cache(SHAPE[0], seq + 2, SHAPE[2], SHAPE[3], jnp.float64, window=window)
      step = self.variant(decode_step)
      for t in range(seq):
        out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
        assert int(cache.length) == t + 1
        assert rel_err(out, expected[:, t : t + 1]) < 1e-12, t
        keys_t = lookahead_keys(*inputs[:3], t + 1, window=window)
        assert rel_err(cache.lookahead_keys[:, : t + 1], keys_t) < 1e-12, t
        assert np.all(np.asarray(cache.lookahead_keys[:, t + 1 :]) == 0)


@pytest.mark.parametrize("window, prompt_len", [(None, 4), (3, 6), (30, 4), (2, 1), (None, 11)])
def test_prefill_then_decode_matches_parallel(window, prompt_len):
  inputs = math_inputs(seed=60 + prompt_len)
  batch, seq, heads, head_dim = SHAPE
  expected = parallel(inputs, window)
  cache = init_cache(batch, seq, heads, head_dim, jnp.float32, window=window)
  if window is not None:
    assert cache.lookahead_queries.shape[1] == min(window, seq)
  out, cache = jax.jit(prefill, static_argnames="block_size")(cache, *(x[:, :prompt_len] for x in inputs), block_size=4)
  assert rel_err(out, expected[:, :prompt_len]) < 1e-5
  keys = lookahead_keys(*inputs[:3], prompt_len, window=window)
  assert rel_err(cache.lookahead_keys[:, :prompt_len], keys) < 1e-5
  step = jax.jit(decode_step)
  for t in range(prompt_len, seq):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    assert rel_err(out, expected[:, t : t + 1]) < 1e-5, t
  assert rel_err(cache.lookahead_keys, lookahead_keys(*inputs[:3], seq, window=window)) < 1e-5


def test_decode_ignores_poisoned_empty_slots():
  """NaN in slots the cache has not written yet must not reach the outputs."""
  inputs = math_inputs(seed=70)
  batch, seq, heads, head_dim = SHAPE
  window = 3
  prompt_len = 4
  cache = init_cache(batch, seq + 3, heads, head_dim, jnp.float32, window=window)
  _, cache = prefill(cache, *(x[:, :prompt_len] for x in inputs))
  empty = (jnp.arange(cache.capacity) >= prompt_len)[None, :, None, None]
  cache = cache.replace(
    **{
      name: jnp.where(empty, jnp.nan, getattr(cache, name))
      for name in ("lookahead_keys", "causal_keys", "causal_values")
    }
  )
  expected = parallel(inputs, window)
  step = jax.jit(decode_step)
  for t in range(prompt_len, seq):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    assert rel_err(out, expected[:, t : t + 1]) < 1e-5, t


def test_decode_bf16_cache_and_inputs():
  inputs = math_inputs(seed=71, dtype=jnp.bfloat16)
  batch, seq, heads, head_dim = SHAPE
  expected = parallel(tuple(x.astype(jnp.float32) for x in inputs), None)
  cache = init_cache(batch, seq, heads, head_dim, jnp.bfloat16)
  out, cache = prefill(cache, *(x[:, :5] for x in inputs))
  outs = [out]
  step = jax.jit(decode_step)
  for t in range(5, seq):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    outs.append(out)
  out = jnp.concatenate(outs, axis=1)
  assert out.dtype == jnp.bfloat16 and cache.lookahead_keys.dtype == jnp.bfloat16
  assert rel_err(out.astype(jnp.float32), expected) < 1e-2


def test_cache_overflow_is_an_error():
  inputs = math_inputs(seed=95)
  batch, _, heads, head_dim = SHAPE
  cache = init_cache(batch, 4, heads, head_dim, jnp.float32, window=2)
  with pytest.raises(ValueError, match="capacity is 4"):
    prefill(cache, *(x[:, :5] for x in inputs))
  with pytest.raises(ValueError, match="window"):
    init_cache(batch, 4, heads, head_dim, jnp.float32, window=0)
  with pytest.raises(ValueError, match="heads"):
    prefill(cache, *(x[:, :2, :2] for x in inputs))

  _, full = prefill(cache, *(x[:, :4] for x in inputs))
  token = tuple(x[:, 4:5] for x in inputs)
  # Eager: the length is concrete, checked on the host.
  with pytest.raises(ValueError, match="overflow"):
    decode_step(full, *token)
  # Under jit with checkify: a runtime error.
  error, _ = jax.jit(checkify.checkify(decode_step))(full, *token)
  with pytest.raises(checkify.JaxRuntimeError, match="overflow"):
    error.throw()
  # Plain jit: NaN output and the cache left as it was.
  out, after = jax.jit(decode_step)(full, *token)
  assert np.all(np.isnan(np.asarray(out)))
  assert int(after.length) == 4
  for name in ("lookahead_keys", "lookahead_queries", "causal_keys", "causal_values"):
    np.testing.assert_array_equal(getattr(after, name), getattr(full, name))
