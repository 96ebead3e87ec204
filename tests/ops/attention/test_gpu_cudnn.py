"""Compiled GPU checks of the cuDNN attention path (skipped without a CUDA GPU)."""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.attention import causal_attention
from helpers import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("kv_heads", [16, 4])
def test_cudnn_matches_reference_at_real_size(window, kv_heads):
  kq, kk, kv, kc = jax.random.split(jax.random.key(0), 4)
  shape_q = (2, 1024, 16, 128)
  shape_kv = (2, 1024, kv_heads, 128)
  q = jax.random.normal(kq, shape_q, jnp.bfloat16)
  k = jax.random.normal(kk, shape_kv, jnp.bfloat16)
  v = jax.random.normal(kv, shape_kv, jnp.bfloat16)
  cot = jax.random.normal(kc, shape_q, jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)

  def loss(impl, cast):
    return lambda q, k, v: jnp.sum(
      f32(causal_attention(cast(q), cast(k), cast(v), window=window, implementation=impl)) * cot
    )

  out = causal_attention(q, k, v, window=window, implementation="cudnn")
  ref = causal_attention(f32(q), f32(k), f32(v), window=window, implementation="reference")
  assert rel_err(f32(out), ref) < 1e-2
  grads = jax.grad(loss("cudnn", lambda x: x), argnums=(0, 1, 2))(q, k, v)
  ref_grads = jax.grad(loss("reference", f32), argnums=(0, 1, 2))(q, k, v)
  for g, rg in zip(grads, ref_grads):
    assert rel_err(f32(g), rg) < 2e-2


def test_default_picks_cudnn_on_gpu_for_bf16():
  q = jax.random.normal(jax.random.key(1), (1, 256, 4, 64), jnp.bfloat16)
  lowered = jax.jit(lambda q: causal_attention(q, q, q)).lower(q).as_text()
  assert "cudnn" in lowered or "custom_call" in lowered


@pytest.mark.parametrize("kv_heads", [12, 4])
def test_alibi_window_cudnn_matches_definition(kv_heads):
  from castle_jax.ops.attention.alibi import alibi_window_attention, alibi_window_reference

  keys = jax.random.split(jax.random.key(2), 4)
  q = jax.random.normal(keys[0], (2, 1300, 12, 64), jnp.bfloat16)
  k, v = (jax.random.normal(key, (2, 1300, kv_heads, 64), jnp.bfloat16) for key in keys[1:3])
  cot = jax.random.normal(keys[3], q.shape, jnp.float32)
  f32 = lambda x: x.astype(jnp.float32)

  def loss(fn, cast, **kw):
    return lambda q, k, v: jnp.sum(f32(fn(cast(q), cast(k), cast(v), window=512, **kw)) * cot)

  out = alibi_window_attention(q, k, v, window=512, implementation="cudnn")
  ref = alibi_window_reference(f32(q), f32(k), f32(v), window=512)
  assert rel_err(f32(out), ref) < 1e-2
  grads = jax.grad(loss(alibi_window_attention, lambda x: x, implementation="cudnn"), argnums=(0, 1, 2))(q, k, v)
  ref_grads = jax.grad(loss(alibi_window_reference, f32), argnums=(0, 1, 2))(q, k, v)
  for g, rg in zip(grads, ref_grads):
    assert rel_err(f32(g), rg) < 2e-2
