"""Every power-attention implementation but the oracle passes the same cases through the
public op (`power_attention(implementation=...)`): outputs and the gradients of q, k, v and
the log-gates against autodiff of the attention form from the definition, float32, p = 2,
grouped-query heads, with and without gating, a length that is no multiple of the chunk. On a
CPU the kernels run in Pallas interpret mode."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import power_attention
from helpers import rel_err

# batch, heads, kv heads, head_dim, value_dim: sizes the kernels take (power-of-two dims >= 16).
SHAPE = dict(batch=1, heads=4, kv_heads=2, head_dim=16, value_dim=16)


def _inputs(seed, seq, gating):
  rng = np.random.default_rng(seed)
  b, h, kv, d, dv = SHAPE.values()
  q, k, v = (
    jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for shape in ((b, seq, h, d), (b, seq, kv, d), (b, seq, kv, dv))
  )
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((b, seq, kv)))), jnp.float32)
  cotangent = jnp.asarray(rng.standard_normal((b, seq, h, dv)), jnp.float32)
  return (q, k, v, log_g if gating else None), cotangent


@pytest.mark.usefixtures("full_float32_matmuls")
@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("seq, gating", [(100, True), (64, False)])
def test_outputs_and_gradients_match_the_attention_form(implementation, seq, gating):
  inputs, cotangent = _inputs(seq, seq, gating)
  argnums = tuple(range(4 if gating else 3))

  def value_and_grads(impl):
    attention = functools.partial(power_attention, chunk_size=64, implementation=impl)
    loss = lambda *a: jnp.sum(attention(*a) * cotangent)
    return jax.jit(attention)(*inputs), jax.jit(jax.grad(loss, argnums=argnums))(*inputs)

  (out, grads), (ref, ref_grads) = value_and_grads(implementation), value_and_grads("reference")
  assert out.shape == ref.shape and rel_err(out, ref) < 1e-5
  for name, grad, ref_grad in zip(("q", "k", "v", "log_g"), grads, ref_grads):
    assert rel_err(grad, ref_grad) < 1e-4, name
