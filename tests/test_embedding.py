"""The token embedding: Embed's forward values, a float32 scatter-add in the backward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.layers.embedding import Embedding


def _table_gradient(module, params, tokens, cotangent):
  _, vjp = jax.vjp(lambda p: module.apply(p, tokens), params)
  return vjp(cotangent)[0]["params"]["embedding"]


def test_embedding_matches_embed_forward_and_accumulates_gradient_in_float32():
  vocab, features = 64, 32
  kwargs = dict(num_embeddings=vocab, features=features, dtype=jnp.bfloat16, param_dtype=jnp.float32)
  ours, flax_embed = Embedding(**kwargs), nn.Embed(**kwargs)
  rng = np.random.default_rng(0)
  # Text-like ids: 4096 tokens over 5 ids, so each row sums ~800 cotangents.
  tokens = jnp.asarray(rng.choice([3, 7, 11, 12, 40], size=(8, 512)), jnp.int32)
  params = ours.init(jax.random.key(0), tokens)
  np.testing.assert_array_equal(ours.apply(params, tokens), flax_embed.apply(params, tokens))
  assert ours.apply(params, tokens).dtype == jnp.bfloat16

  cotangent = jnp.asarray(rng.normal(size=(8, 512, features)), jnp.bfloat16)
  expected = np.zeros((vocab, features))
  np.add.at(expected, np.asarray(tokens), np.asarray(cotangent, np.float64))

  def relative_error(gradient):
    return np.linalg.norm(np.asarray(gradient, np.float64) - expected) / np.linalg.norm(expected)

  assert relative_error(_table_gradient(ours, params, tokens, cotangent)) < 1e-6
  # Embed casts the table first, so its scatter-add sums in bfloat16: the test would
  # catch a return to that.
  assert relative_error(_table_gradient(flax_embed, params, tokens, cotangent)) > 1e-3


@pytest.mark.parametrize("shape", [(1, 1), (1,), ()])
def test_one_token_is_looked_up_as_any_other(shape):
  # One token takes its own path (a gather of two rows, so XLA keeps it a gather on a table
  # split over devices); its row and its gradient must be the plain lookup's.
  module = Embedding(num_embeddings=16, features=4, dtype=jnp.float32)
  params = module.init(jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
  table = params["params"]["embedding"]
  token = jnp.full(shape, 5, jnp.int32)
  out = module.apply(params, token)
  assert out.shape == (*shape, 4)
  np.testing.assert_array_equal(out.reshape(4), table[5])
  cotangent = jnp.arange(4.0).reshape(*shape, 4) + 1.0
  gradient = _table_gradient(module, params, token, cotangent)
  np.testing.assert_array_equal(gradient, jnp.zeros_like(table).at[5].set(cotangent.reshape(4)))


def test_embedding_rejects_float_inputs():
  with pytest.raises(ValueError, match="integer token ids"):
    Embedding(num_embeddings=8, features=4).init(jax.random.key(0), jnp.zeros((2, 3), jnp.float32))
