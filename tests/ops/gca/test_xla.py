"""The XLA path (`castle_jax.ops.gca.xla`, one retrieved chunk at a time with a custom VJP) against
the reference: outputs and every gradient with an empty slot and a chunk retrieved twice,
bf16, and zero weights.
"""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.gca import (
  gca_attention,
  gca_chunked,
  gca_reference,
)
from helpers import rel_err
from ops.gca.base import small_inputs


@pytest.mark.parametrize(
  "case",
  [
    dict(),
    dict(heads=3, kv_heads=3, head_dim=5, chunk_len=7, query_len=1, top_k=1),
    dict(batch=1, heads=6, kv_heads=1, query_chunks=4, memory_chunks=2, top_k=5),  # k > memory chunks
  ],
)
def test_xla_path_matches_reference_outputs_and_gradients(case, full_float32_matmuls):
  q, chunk_k, chunk_v, weights, indices = small_inputs(1, **case)
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
  inputs32 = small_inputs(3)
  q, chunk_k, chunk_v, weights, indices = (x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in inputs32)
  out = jax.jit(gca_chunked)(q, chunk_k, chunk_v, weights, indices)
  assert out.dtype == jnp.bfloat16
  expected = jax.jit(gca_reference)(
    *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in (q, chunk_k, chunk_v, weights, indices))
  )
  assert rel_err(out, expected) < 1e-2


def test_zero_weights_give_zero_output_and_no_memory_gradient():
  q, chunk_k, chunk_v, weights, indices = small_inputs(4)
  weights = weights.at[:, 0].set(0.0)  # query chunk 0 retrieved nothing
  out = gca_attention(q, chunk_k, chunk_v, weights, indices)
  query_len = q.shape[1] // weights.shape[1]
  assert float(jnp.max(jnp.abs(out[:, :query_len]))) == 0.0
  only_first = lambda k, v: jnp.sum(gca_attention(q, k, v, weights, indices)[:, :query_len])
  d_k, d_v = jax.grad(only_first, argnums=(0, 1))(chunk_k, chunk_v)
  assert float(jnp.max(jnp.abs(d_k))) == 0.0 and float(jnp.max(jnp.abs(d_v))) == 0.0
