"""GCA: softmax_1 and the reference against direct formulas, the XLA path against the
reference (outputs and every gradient), causal top-k retrieval, bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.gca import (
  causal_chunk_mask,
  gca_attention,
  gca_chunked,
  gca_reference,
  retrieval_scores,
  select_chunks,
  softmax_one,
)
from helpers import rel_err


def _inputs(
  seed,
  *,
  batch=2,
  query_chunks=3,
  query_len=5,
  heads=4,
  kv_heads=2,
  head_dim=8,
  memory_chunks=4,
  chunk_len=6,
  top_k=3,
  dtype=jnp.float32,
):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (batch, query_chunks * query_len, heads, head_dim), dtype)
  chunk_k = jax.random.normal(keys[1], (batch, memory_chunks, chunk_len, kv_heads, head_dim), dtype)
  chunk_v = jax.random.normal(keys[2], (batch, memory_chunks, chunk_len, kv_heads, head_dim), dtype)
  weights = jax.nn.softmax(jax.random.normal(keys[3], (batch, query_chunks, top_k)), axis=-1)
  indices = jax.random.randint(keys[4], (batch, query_chunks, top_k), 0, memory_chunks)
  return q, chunk_k, chunk_v, weights, indices


def _direct_gca(q, chunk_k, chunk_v, weights, indices):
  """Loops over every (batch, query chunk, slot, head, row) in float64 numpy."""
  q, chunk_k, chunk_v, weights = (np.asarray(x, np.float64) for x in (q, chunk_k, chunk_v, weights))
  indices = np.asarray(indices)
  batch, seq, heads, head_dim = q.shape
  query_chunks, top_k = indices.shape[1:]
  query_len, group = seq // query_chunks, heads // chunk_k.shape[3]
  out = np.zeros_like(q)
  for b, c, j, h in itertools.product(range(batch), range(query_chunks), range(top_k), range(heads)):
    keys = chunk_k[b, indices[b, c, j], :, h // group]
    values = chunk_v[b, indices[b, c, j], :, h // group]
    for i in range(query_len):
      row = c * query_len + i
      e = np.exp(keys @ q[b, row, h] / np.sqrt(head_dim))
      out[b, row, h] += weights[b, c, j] * (e / (1.0 + e.sum())) @ values
  return out


def test_softmax_one_matches_the_formula_and_does_not_overflow():
  z = np.random.default_rng(0).normal(size=(5, 7)) * 3
  e = np.exp(z)
  np.testing.assert_allclose(softmax_one(jnp.asarray(z)), e / (1 + e.sum(-1, keepdims=True)), rtol=1e-6)
  big = softmax_one(jnp.asarray([[1000.0, 1000.0], [-1000.0, -1000.0]]))
  np.testing.assert_allclose(big, [[0.5, 0.5], [0.0, 0.0]], atol=1e-6)
  # The implicit zero logit keeps the row sum below 1: a query can ignore a chunk.
  assert float(jnp.sum(softmax_one(jnp.zeros(4)))) == pytest.approx(0.8)


def test_reference_matches_a_direct_loop():
  inputs = _inputs(0)
  assert rel_err(gca_reference(*inputs), _direct_gca(*inputs)) < 1e-6


@pytest.mark.parametrize(
  "case",
  [
    dict(),
    dict(heads=3, kv_heads=3, head_dim=5, chunk_len=7, query_len=1, top_k=1),
    dict(batch=1, heads=6, kv_heads=1, query_chunks=4, memory_chunks=2, top_k=5),  # k > memory chunks
  ],
)
def test_xla_path_matches_reference_outputs_and_gradients(case, full_float32_matmuls):
  q, chunk_k, chunk_v, weights, indices = _inputs(1, **case)
  if weights.shape[-1] > 1:
    # An empty slot (weight 0) and a chunk retrieved twice by one query chunk.
    weights = weights.at[:, 0, -1].set(0.0)
    indices = indices.at[:, 0, 0].set(indices[:, 0, -1])
  cotangent = jax.random.normal(jax.random.key(2), q.shape)

  def loss(fn):
    return lambda q, k, v, w: jnp.sum(fn(q, k, v, w, indices) * cotangent)

  expected = jax.jit(gca_reference)(q, chunk_k, chunk_v, weights, indices)
  assert rel_err(jax.jit(gca_chunked)(q, chunk_k, chunk_v, weights, indices), expected) < 1e-5
  want = jax.jit(jax.grad(loss(gca_reference), argnums=(0, 1, 2, 3)))(q, chunk_k, chunk_v, weights)
  got = jax.jit(jax.grad(loss(gca_chunked), argnums=(0, 1, 2, 3)))(q, chunk_k, chunk_v, weights)
  for name, g, w in zip(("q", "chunk_k", "chunk_v", "chunk_weights"), got, want):
    assert rel_err(g, w) < 1e-5, name


def test_xla_path_bfloat16_against_float32_reference():
  inputs32 = _inputs(3)
  q, chunk_k, chunk_v, weights, indices = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in inputs32)
  out = jax.jit(gca_chunked)(q, chunk_k, chunk_v, weights, indices)
  assert out.dtype == jnp.bfloat16
  expected = jax.jit(gca_reference)(
    *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in (q, chunk_k, chunk_v, weights, indices))
  )
  assert rel_err(out, expected) < 1e-2


def test_zero_weights_give_zero_output_and_no_memory_gradient():
  q, chunk_k, chunk_v, weights, indices = _inputs(4)
  weights = weights.at[:, 0].set(0.0)  # query chunk 0 retrieved nothing
  out = gca_attention(q, chunk_k, chunk_v, weights, indices)
  query_len = q.shape[1] // weights.shape[1]
  assert float(jnp.max(jnp.abs(out[:, :query_len]))) == 0.0
  only_first = lambda k, v: jnp.sum(gca_attention(q, k, v, weights, indices)[:, :query_len])
  d_k, d_v = jax.grad(only_first, argnums=(0, 1))(chunk_k, chunk_v)
  assert float(jnp.max(jnp.abs(d_k))) == 0.0 and float(jnp.max(jnp.abs(d_v))) == 0.0


def test_entry_point_implementations_agree_and_reject_unknown():
  inputs = _inputs(5)
  assert rel_err(gca_attention(*inputs), gca_attention(*inputs, implementation="reference")) < 1e-5
  with pytest.raises(ValueError, match="gca_attention: unknown implementation 'cudnn'"):
    gca_attention(*inputs, implementation="cudnn")
  # head_dim 8: the default skips the kernels, an explicit "triton" names why (tests/test_gca_pallas.py).
  with pytest.raises(ValueError, match="implementation='triton' cannot run: .*power-of-two head_dim"):
    gca_attention(*inputs, implementation="triton")


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda a: (a[0][:, :-1], *a[1:]), "multiple of the query chunks"),
    (lambda a: (a[0], a[1][..., :4], a[2][..., :4], *a[3:]), "head_dim"),
    (lambda a: (a[0], a[1], a[2][:, :2], *a[3:]), "same shape"),
    (lambda a: (*a[:3], a[3][..., :2], a[4]), "chunk_weights"),
    (lambda a: (*a[:4], a[4].astype(jnp.float32)), "must be integers"),
    (lambda a: (a[0][..., :3, :], *a[1:]), "multiple of chunk_k/chunk_v kv_heads"),
    (lambda a: (*a[:3], a[3][..., :0], a[4][..., :0]), "k >= 1"),
  ],
)
def test_bad_inputs_name_the_argument(change, message):
  with pytest.raises(ValueError, match=message):
    gca_attention(*change(_inputs(6)))


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
