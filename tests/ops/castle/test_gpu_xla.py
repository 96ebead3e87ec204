"""Compiled GPU checks of the CASTLE XLA paths at a real head size (skipped without a CUDA GPU)."""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.castle import castle_attention, decode_step, init_cache, prefill
from helpers import rel_err

pytestmark = pytest.mark.gpu

SHAPE = (2, 700, 3, 128)  # 700: not a multiple of the block size


def _inputs(seed, dtype):
  keys = jax.random.split(jax.random.key(seed), 7)
  inputs = tuple(jax.random.normal(k, SHAPE, jnp.float32).astype(dtype) for k in keys[:6])
  return inputs, jax.random.normal(keys[6], SHAPE, jnp.float32)


def _loss(impl, window):
  def loss(*inputs_and_cot):
    *inputs, cot = inputs_and_cot
    out = castle_attention(*inputs, window=window, implementation=impl)
    return jnp.sum(out.astype(jnp.float32) * cot)

  return loss


@pytest.mark.parametrize("window", [None, 128])
def test_blockwise_bf16_matches_float32_reference(window):
  inputs, cot = _inputs(0, jnp.bfloat16)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(lambda *a: castle_attention(*a, window=window, implementation="reference"))(*f32)
    ref_grads = jax.jit(jax.grad(_loss("reference", window), argnums=range(6)))(*f32, cot)
  out = jax.jit(lambda *a: castle_attention(*a, window=window, implementation="xla"))(*inputs)
  grads = jax.jit(jax.grad(_loss("xla", window), argnums=range(6)))(*inputs, cot)
  assert out.dtype == jnp.bfloat16
  assert rel_err(out.astype(jnp.float32), ref) < 1e-2
  for g, rg in zip(grads, ref_grads):
    assert rel_err(g.astype(jnp.float32), rg) < 2e-2


def test_prefill_and_decode_match_reference():
  inputs, _ = _inputs(1, jnp.float32)
  prompt = 650
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(lambda *a: castle_attention(*a, implementation="reference"))(*inputs)
    cache = init_cache(SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[3], jnp.float32)
    out, cache = jax.jit(prefill)(cache, *(x[:, :prompt] for x in inputs))
    assert rel_err(out, ref[:, :prompt]) < 1e-5
    step = jax.jit(decode_step)
    for t in range(prompt, SHAPE[1]):
      out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    assert rel_err(out, ref[:, -1:]) < 1e-5
