"""Sliding-window ALiBi attention: the blockwise path against the full-mask definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.attention.alibi import alibi_slopes, alibi_window_attention, alibi_window_reference
from helpers import rel_err


def test_slopes_follow_the_formula():
  np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
  np.testing.assert_allclose(alibi_slopes(12)[:2], [2 ** (-8 / 12), 2 ** (-16 / 12)], rtol=1e-6)


@pytest.mark.parametrize("seq, window, heads, kv_heads", [(37, 8, 4, 2), (16, 16, 3, 3), (5, 9, 2, 1), (24, 1, 2, 2)])
def test_blockwise_matches_definition_with_gradients(seq, window, heads, kv_heads, full_float32_matmuls):
  keys = jax.random.split(jax.random.key(seq + window), 4)
  q = jax.random.normal(keys[0], (2, seq, heads, 8))
  k, v = (jax.random.normal(key, (2, seq, kv_heads, 8)) for key in keys[1:3])
  cotangent = jax.random.normal(keys[3], q.shape)
  expected = jax.jit(alibi_window_reference, static_argnames="window")(q, k, v, window=window)
  assert rel_err(jax.jit(alibi_window_attention, static_argnames="window")(q, k, v, window=window), expected) < 1e-5
  loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v, window=window) * cotangent)
  got = jax.jit(jax.grad(loss(alibi_window_attention), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(alibi_window_reference), argnums=(0, 1, 2)))(q, k, v)
  for name, g, w in zip("qkv", got, want):
    assert rel_err(g, w) < 1e-5, name


def test_keys_outside_the_window_do_not_matter():
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 20, 2, 4)) for i in range(3))
  out = alibi_window_attention(q, k, v, window=4)
  # Position 10 sees 7..10: changing keys/values at 0..6 and 11.. leaves it unchanged.
  k2 = k.at[:, :7].add(3.0).at[:, 11:].add(3.0)
  v2 = v.at[:, :7].add(3.0).at[:, 11:].add(3.0)
  np.testing.assert_allclose(alibi_window_attention(q, k2, v2, window=4)[:, 10], out[:, 10], rtol=1e-6)


def test_unknown_implementation_is_named():
  x = jnp.zeros((1, 4, 1, 2))
  with pytest.raises(ValueError, match="'triton'"):
    alibi_window_attention(x, x, x, window=2, implementation="triton")


def test_mha_layer_with_alibi_decodes_like_its_training_forward():
  """The `mha` layer with positions='alibi': the blockwise training path and the
  KV-cache decode path (masked attention with an ALiBi bias) give the same outputs."""
  from castle_jax.config import ModelConfig
  from castle_jax.layers.mha import MultiHeadAttention, cache_for

  config = ModelConfig(
    d_model=32, n_heads=4, n_kv_heads=2, dtype="float32", sliding_window=5, attention_kwargs=(("positions", "alibi"),)
  )
  layer = MultiHeadAttention(config)
  x = jax.random.normal(jax.random.key(0), (2, 13, 32))
  positions = jnp.broadcast_to(jnp.arange(13), (2, 13))
  params = layer.init(jax.random.key(1), x, positions)
  apply = jax.jit(layer.apply)  # one compile for the forward pass, one for a decode step
  trained, _ = apply(params, x, positions)
  cache = cache_for(config, 2, 16)
  steps = []
  for t in range(13):
    out, cache = apply(params, x[:, t : t + 1], positions[:, t : t + 1], cache)
    steps.append(out)
  assert rel_err(jnp.concatenate(steps, axis=1), trained) < 1e-5


def test_alibi_needs_a_window():
  from castle_jax.config import ModelConfig

  with pytest.raises(ValueError, match="set model.sliding_window"):
    ModelConfig(attention_kwargs=(("positions", "alibi"),))
  with pytest.raises(ValueError, match="positions must be one of"):
    ModelConfig(sliding_window=4, attention_kwargs=(("positions", "nope"),))
