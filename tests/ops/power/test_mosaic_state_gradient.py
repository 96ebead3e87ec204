"""The Mosaic GPU state-gradient kernel of power attention on CPU: GPU interpret mode runs the same
kernel code, and the Mosaic lowering for an H100 runs on CPU.

Against jax's gradient of f_i = phi(x_i) . (S_c c_i + z_c c^z_i) written with the tspow expansion
(16-feature tiles) in float32, f itself and phi(x) S, and against the Triton kernel in interpret
mode; grouped heads, two chunks, head dims 64 and 128, with and without the product, a ring
shallower than the row blocks, and bad input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import expand
from helpers import mosaic_kernels_lowered_for_h100, rel_err
from pallas_kernels.power import PowerTritonConfig, mosaic_state_gradient, triton_kernels

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

B, HQ, HKV, CHUNK = 1, 4, 2, 64


def _inputs(seed, seq, head_dim, value_dim, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  dim = triton_kernels.expanded_dim(head_dim)
  normal = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)
  x = normal(B * HQ, seq, head_dim, scale=head_dim**-0.25)
  cotangent = normal(B * HQ, seq, value_dim)
  cotangent_normalizer = jnp.asarray(rng.standard_normal((B * HQ, seq)), jnp.float32)
  state = normal(B * HKV, seq // CHUNK, dim, value_dim, scale=0.1)
  normalizer = jnp.asarray(rng.uniform(0.0, 1.0, (B * HKV, seq // CHUNK, dim)), jnp.float32)
  return x, cotangent, cotangent_normalizer, state, normalizer


def _definition(x, cotangent, cotangent_normalizer, state, normalizer):
  """(dx, f, phi(x) S) in float32."""
  group = HQ // HKV
  heads = lambda a: jnp.repeat(a.astype(jnp.float32), group, axis=0)
  per_row = lambda a: jnp.repeat(a, CHUNK, axis=1)  # each row's chunk
  state, normalizer = per_row(heads(state)), per_row(heads(normalizer))  # [BHq, T, D, d_v], [BHq, T, D]

  def f(x):
    phi = expand(x, 2, "tspow", 16)
    m = jnp.einsum("btDe,bte->btD", state, cotangent.astype(jnp.float32)) + normalizer * cotangent_normalizer[..., None]
    return jnp.sum(phi * m, axis=-1)

  values, vjp = jax.vjp(f, x.astype(jnp.float32))
  (dx,) = vjp(jnp.ones_like(values))
  product = jnp.einsum("btD,btDe->bte", expand(x.astype(jnp.float32), 2, "tspow", 16), state)
  return dx, values, product


def _ours(*inputs, stages=2, with_product=True):
  return mosaic_state_gradient.state_gradient(
    *inputs, heads=HQ, kv_heads=HKV, chunk=CHUNK, with_product=with_product, stages=stages, interpret=True
  )


# Two chunks at head dim 64; one at 128 (144 row blocks: interpret mode's time).
@pytest.mark.parametrize(
  "head_dim, value_dim, stages, with_product, chunks", [(64, 64, 2, True, 2), (128, 64, 1, False, 1)]
)
def test_matches_the_definition(head_dim, value_dim, stages, with_product, chunks):
  inputs = _inputs(0, chunks * CHUNK, head_dim, value_dim)
  ours = jax.jit(functools.partial(_ours, stages=stages, with_product=with_product))(*inputs)
  expected = _definition(*inputs)
  assert len(ours) == (3 if with_product else 2)
  for name, a, b in zip(("dx", "f", "product"), ours, expected):
    assert rel_err(a, b) < 1e-2, name


def test_matches_the_triton_kernel():
  inputs = _inputs(1, 2 * CHUNK, 64, 64)
  ours = jax.jit(_ours)(*inputs)
  theirs = jax.jit(
    functools.partial(
      triton_kernels.state_gradient,
      heads=HQ,
      kv_heads=HKV,
      chunk=CHUNK,
      config=PowerTritonConfig(),
      interpret=True,
      with_product=True,
    )
  )(*inputs)
  for a, b in zip(ours, theirs):
    assert rel_err(a, b) < 1e-2


def test_lowers_for_an_h100():
  calls = [
    functools.partial(mosaic_state_gradient.state_gradient, heads=HQ, kv_heads=HKV, chunk=CHUNK, with_product=p)
    for p in (False, True)
  ]
  assert mosaic_kernels_lowered_for_h100(calls, _inputs(2, 2 * CHUNK, 64, 64)) == [1, 1]


def test_bad_input():
  x, cotangent, cotangent_normalizer, state, normalizer = _inputs(3, 2 * CHUNK, 64, 64)
  call = functools.partial(mosaic_state_gradient.state_gradient, heads=HQ, kv_heads=HKV, chunk=CHUNK)
  with pytest.raises(ValueError, match="16-bit operands"):
    call(x.astype(jnp.float32), cotangent, cotangent_normalizer, state, normalizer)
  with pytest.raises(ValueError, match="cotangent must be in the rows' dtype"):
    call(x, cotangent.astype(jnp.float16), cotangent_normalizer, state, normalizer)


def test_the_op_takes_it_from_the_kernel_config(monkeypatch):
  """power_attention_triton with state_gradient="mosaic": the kernel runs for the queries and the
  keys, and the gradients agree with the Triton kernel's."""
  from pallas_kernels.power import power_attention_triton

  calls = []
  kernel = mosaic_state_gradient.state_gradient
  monkeypatch.setattr(mosaic_state_gradient, "state_gradient", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  rng = np.random.default_rng(4)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q, k, v = normal(1, 100, HQ, 64), normal(1, 100, HKV, 64), normal(1, 100, HKV, 64)
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((1, 100, HKV)))), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

  def grads(config):
    def loss(q, k, v, log_g):
      out, _ = power_attention_triton(q, k, v, log_g, scale=0.125, chunk_size=64, config=config)
      return jnp.sum(out.astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=range(4)))(q, k, v, log_g)

  ours = grads(PowerTritonConfig(state_gradient="mosaic"))
  assert len(calls) == 2
  theirs = grads(PowerTritonConfig())
  for name, a, b in zip(("q", "k", "v", "log_g"), ours, theirs):
    assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < 2e-2, name
