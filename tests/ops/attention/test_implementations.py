"""Every standard-attention implementation but the oracle passes the same cases through the
public op (`causal_attention(implementation=...)`): outputs and the gradients of q, k and v
against autodiff of the masked reference, grouped-query heads, full causal, a sliding window
and ALiBi. "cudnn" needs a CUDA GPU (and 16-bit inputs): its cases run there only."""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.attention import causal_attention
from helpers import HOPPER, rel_err

IMPLEMENTATIONS = ["xla", pytest.param("cudnn", marks=pytest.mark.gpu)]


@pytest.mark.usefixtures("full_float32_matmuls")
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("window, alibi", [(None, False), (5, False), (6, True)])
def test_outputs_and_gradients_match_the_reference(implementation, window, alibi):
  dtype, tol = (jnp.float32, 1e-5) if implementation == "xla" else (jnp.bfloat16, 2e-2)
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 24, 4, 16), jnp.float32)
  k, v = (jax.random.normal(key, (2, 24, 2, 16), jnp.float32) for key in keys[1:3])
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)

  def value_and_grads(impl, cast):
    attention = lambda q, k, v: causal_attention(
      cast(q), cast(k), cast(v), window=window, alibi=alibi, implementation=impl
    )
    loss = lambda *a: jnp.sum(attention(*a).astype(jnp.float32) * cotangent)
    return attention(q, k, v).astype(jnp.float32), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  out, grads = value_and_grads(implementation, lambda x: x.astype(dtype))
  ref, ref_grads = value_and_grads("reference", lambda x: x)
  assert rel_err(out, ref) < tol
  for name, grad, ref_grad in zip("qkv", grads, ref_grads):
    assert rel_err(grad, ref_grad) < tol, name


def test_cudnn_alibi_with_an_odd_window_is_refused_and_the_default_takes_xla(device):
  device(HOPPER)
  q, k, v = (jnp.ones((1, 10, 2, 16), jnp.bfloat16) for _ in range(3))
  with pytest.raises(ValueError, match="cuDNN ALiBi attention needs an even window .* got 5"):
    causal_attention(q, k, v, window=5, alibi=True, implementation="cudnn")
  reference = causal_attention(q, k, v, window=5, alibi=True, implementation="reference")
  assert rel_err(causal_attention(q, k, v, window=5, alibi=True), reference) < 1e-2
