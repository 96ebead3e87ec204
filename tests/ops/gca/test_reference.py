"""The oracle (`castle_jax.ops.gca.reference`): softmax_1 against its formula, the reference
against a direct float64 loop, and causal top-k retrieval (`select_chunks`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.gca import (
  causal_chunk_mask,
  gca_reference,
  retrieval_scores,
  select_chunks,
  softmax_one,
)
from helpers import rel_err
from ops.gca.base import direct_gca, small_inputs


def test_softmax_one_matches_the_formula_and_does_not_overflow():
  z = np.random.default_rng(0).normal(size=(5, 7)) * 3
  e = np.exp(z)
  np.testing.assert_allclose(softmax_one(jnp.asarray(z)), e / (1 + e.sum(-1, keepdims=True)), rtol=1e-6)
  big = softmax_one(jnp.asarray([[1000.0, 1000.0], [-1000.0, -1000.0]]))
  np.testing.assert_allclose(big, [[0.5, 0.5], [0.0, 0.0]], atol=1e-6)
  # The implicit zero logit keeps the row sum below 1: a query can ignore a chunk.
  assert float(jnp.sum(softmax_one(jnp.zeros(4)))) == pytest.approx(0.8)


def test_reference_matches_a_direct_loop():
  inputs = small_inputs(0)
  assert rel_err(gca_reference(*inputs), direct_gca(*inputs)) < 1e-6


def test_retrieval_is_causal_and_weights_are_the_softmax_of_selected_scores():
  batch, chunks, dim, top_k = 2, 6, 8, 3
  queries = jax.random.normal(jax.random.key(7), (batch, chunks, dim))
  landmarks = jax.random.normal(jax.random.key(8), (batch, chunks, dim))
  scores = retrieval_scores(queries, landmarks)
  np.testing.assert_array_equal(jnp.isfinite(scores[0]), causal_chunk_mask(chunks))
  indices, weights = select_chunks(scores, top_k)
  # Chunk 0 has nothing to retrieve; chunk t has min(t, k) non-empty slots summing to 1.
  for t in range(chunks):
    np.testing.assert_array_equal(np.asarray(weights[:, t] > 0).sum(-1), min(t, top_k))
    assert np.all(np.asarray(indices[:, t])[np.asarray(weights[:, t] > 0)] < t)
  np.testing.assert_allclose(weights[:, 1:].sum(-1), 1.0, rtol=1e-6)
  expected = jax.nn.softmax(jnp.sort(jnp.where(jnp.isfinite(scores), scores, -1e9), axis=-1)[..., -top_k:], -1)
  np.testing.assert_allclose(jnp.sort(weights[:, top_k:], -1), jnp.sort(expected[:, top_k:], -1), rtol=1e-5)

  # Changing the landmarks of chunks >= t changes nothing that chunks <= t retrieve.
  t = 3
  moved = landmarks.at[:, t:].add(5.0 * jax.random.normal(jax.random.key(9), (batch, chunks - t, dim)))
  moved_indices, moved_weights = select_chunks(retrieval_scores(queries, moved), top_k)
  np.testing.assert_array_equal(moved_indices[:, : t + 1], indices[:, : t + 1])
  np.testing.assert_array_equal(moved_weights[:, : t + 1], weights[:, : t + 1])


def test_gradients_reach_selected_scores_only():
  scores = jnp.where(causal_chunk_mask(5), jax.random.normal(jax.random.key(10), (5, 5)), -jnp.inf)
  cotangent = jax.random.normal(jax.random.key(11), (5, 2))
  grad = jax.grad(lambda s: jnp.sum(select_chunks(s, 2)[1] * cotangent))(scores)
  assert np.all(np.isfinite(grad))
  indices, weights = select_chunks(scores, 2)
  chosen = np.zeros((5, 5), bool)
  for t in range(5):
    chosen[t, np.asarray(indices[t])[np.asarray(weights[t]) > 0]] = True
  assert np.all(np.asarray(grad)[~chosen] == 0.0)
  assert np.any(np.asarray(grad)[chosen] != 0.0)


def test_gumbel_noise_only_with_a_key_and_ties_go_to_the_lower_index():
  scores = jnp.where(causal_chunk_mask(40), jax.random.normal(jax.random.key(12), (40, 40)), -jnp.inf)
  plain = select_chunks(scores, 4)
  np.testing.assert_array_equal(select_chunks(scores, 4)[0], plain[0])
  noisy = select_chunks(scores, 4, gumbel_rng=jax.random.key(13))[0]
  assert np.any(np.asarray(noisy) != np.asarray(plain[0]))
  np.testing.assert_array_equal(select_chunks(scores, 4, gumbel_rng=jax.random.key(13))[0], noisy)
  tied = jnp.zeros((1, 6)).at[0, 5].set(-jnp.inf)
  np.testing.assert_array_equal(select_chunks(tied, 3)[0], [[0, 1, 2]])


@pytest.mark.parametrize("top_k, message", [(0, "top_k must be an int >= 1"), (9, "exceeds the 8 memory chunks")])
def test_select_chunks_rejects_bad_k(top_k, message):
  with pytest.raises(ValueError, match=message):
    select_chunks(jnp.zeros((3, 8)), top_k)
