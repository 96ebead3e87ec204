"""The Mosaic GPU kernel of the states' part of power attention's outputs on CPU: GPU interpret
mode runs the same kernel code, and the Mosaic lowering for an H100 runs on CPU.

Against e^{G_i} phi(q_i) S_c and e^{G_i} phi(q_i) . z_c from the definition with the tspow
expansion (16-feature tiles) in float32, and against the Triton query-state kernel without the
attention in interpret mode; grouped heads, two chunks, head dims 64 and 128, a ring shallower
than the row blocks, and bad input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import expand
from helpers import mosaic_kernels_lowered_for_h100, rel_err
from pallas_kernels.power import PowerTritonConfig, mosaic_query_state, triton_kernels

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

B, HQ, HKV, CHUNK = 1, 4, 2, 64


def _inputs(seed, seq, head_dim, value_dim, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  dim = triton_kernels.expanded_dim(head_dim)
  q = jnp.asarray(rng.standard_normal((B * HQ, seq, head_dim)) * head_dim**-0.25, dtype)
  log_g = -np.logaddexp(0.0, -(2.0 + rng.standard_normal((B * HKV, seq // CHUNK, CHUNK))))
  g = jnp.asarray(np.cumsum(log_g, axis=-1).reshape(B * HKV, seq), jnp.float32)
  state = jnp.asarray(rng.standard_normal((B * HKV, seq // CHUNK, dim, value_dim)) * 0.1, dtype)
  normalizer = jnp.asarray(rng.uniform(0.0, 1.0, (B * HKV, seq // CHUNK, dim)), jnp.float32)
  return q, g, state, normalizer


def _definition(q, g, state, normalizer):
  group = HQ // HKV
  phi = expand(q.astype(jnp.float32), 2, "tspow", 16).reshape(B * HQ, -1, CHUNK, state.shape[2])
  expand_heads = lambda x: jnp.repeat(x, group, axis=0)
  discount = jnp.exp(expand_heads(g)).reshape(B * HQ, -1, CHUNK)
  numerator = jnp.einsum("bntD,bnDe->bnte", phi, expand_heads(state).astype(jnp.float32)) * discount[..., None]
  denominator = jnp.einsum("bntD,bnD->bnt", phi, expand_heads(normalizer)) * discount
  return numerator.reshape(B * HQ, -1, state.shape[-1]), denominator.reshape(B * HQ, -1)


def _ours(*inputs, stages=2):
  return mosaic_query_state.query_state(*inputs, heads=HQ, kv_heads=HKV, chunk=CHUNK, stages=stages, interpret=True)


# Two chunks at head dim 64; one at 128 (144 row blocks: interpret mode's time).
@pytest.mark.parametrize("head_dim, value_dim, stages, chunks", [(64, 64, 2, 2), (128, 64, 1, 1)])
def test_matches_the_definition(head_dim, value_dim, stages, chunks):
  inputs = _inputs(0, chunks * CHUNK, head_dim, value_dim)
  numerator, denominator = jax.jit(functools.partial(_ours, stages=stages))(*inputs)
  expected_numerator, expected_denominator = _definition(*inputs)
  assert rel_err(numerator, expected_numerator) < 1e-2
  assert rel_err(denominator, expected_denominator) < 1e-2


def test_matches_the_triton_kernel():
  q, g, state, normalizer = _inputs(1, 2 * CHUNK, 64, 64)
  ours = jax.jit(_ours)(q, g, state, normalizer)
  k = jnp.zeros((B * HKV, *q.shape[1:]), q.dtype)
  v = jnp.zeros((B * HKV, q.shape[1], state.shape[-1]), q.dtype)
  theirs = jax.jit(
    functools.partial(
      triton_kernels.query_state_attention,
      heads=HQ,
      kv_heads=HKV,
      chunk=CHUNK,
      config=PowerTritonConfig(),
      interpret=True,
      with_attention=False,
    )
  )(q, k, v, g, state, normalizer)
  for a, b in zip(ours, theirs):
    assert rel_err(a, b) < 1e-2


def test_lowers_for_an_h100():
  call = functools.partial(mosaic_query_state.query_state, heads=HQ, kv_heads=HKV, chunk=CHUNK)
  assert mosaic_kernels_lowered_for_h100([call], _inputs(2, 2 * CHUNK, 64, 64)) == [1]


def test_bad_input():
  q, g, state, normalizer = _inputs(3, 2 * CHUNK, 64, 64)
  with pytest.raises(ValueError, match="16-bit operands"):
    mosaic_query_state.query_state(
      q.astype(jnp.float32), g, state.astype(jnp.float32), normalizer, heads=HQ, kv_heads=HKV, chunk=CHUNK
    )
  with pytest.raises(ValueError, match="state must be in the rows' dtype"):
    mosaic_query_state.query_state(q, g, state.astype(jnp.float16), normalizer, heads=HQ, kv_heads=HKV, chunk=CHUNK)


def test_the_op_takes_it_from_the_kernel_config(monkeypatch):
  """power_attention_triton with query_state="mosaic" (and the in-chunk attention on Mosaic GPU,
  which it needs): the kernel runs and the outputs agree with the Triton kernels'."""
  from pallas_kernels.power import power_attention_triton

  calls = []
  kernel = mosaic_query_state.query_state
  monkeypatch.setattr(mosaic_query_state, "query_state", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  rng = np.random.default_rng(4)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q, k, v = normal(1, 100, HQ, 64), normal(1, 100, HKV, 64), normal(1, 100, HKV, 64)
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((1, 100, HKV)))), jnp.float32)
  run = lambda config: jax.jit(
    functools.partial(power_attention_triton, scale=0.125, chunk_size=64, config=config, return_final_state=False)
  )(q, k, v, log_g)[0]
  ours = run(PowerTritonConfig(in_chunk_attention="mosaic", query_state="mosaic"))
  assert calls
  theirs = run(PowerTritonConfig())
  assert rel_err(ours.astype(jnp.float32), theirs.astype(jnp.float32)) < 2e-2
  with pytest.raises(ValueError, match="needs in_chunk_attention='mosaic'"):
    PowerTritonConfig(query_state="mosaic")
