"""Standard causal attention: fast paths against the masked reference."""

import functools

from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.attention import causal_attention, causal_mask
from helpers import assert_close, rel_err


def _qkv(seed, batch=2, seq=13, heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (batch, seq, heads, head_dim), dtype)
  k = jax.random.normal(kk, (batch, seq, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, seq, kv_heads, head_dim), dtype)
  return q, k, v


def test_mask_counts_window_keys_including_self():
  pos = jnp.arange(6)[None]
  mask = causal_mask(pos, pos, window=3)
  np.testing.assert_array_equal(mask[0].sum(-1), [1, 2, 3, 3, 3, 3])
  assert not mask[0, 5, 2] and mask[0, 5, 3]


class XlaMatchesReferenceTest(chex.TestCase):
  """The XLA path against the masked reference, outputs and gradients, with and
  without jit (chex variants: the op must not depend on being traced)."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.product(window=[None, 1, 4, 40], kv_heads=[4, 2, 1])
  def test_outputs_and_grads(self, window, kv_heads):
    q, k, v = _qkv(seed=kv_heads * 100 + (window or 0), kv_heads=kv_heads)
    cot = jax.random.normal(jax.random.key(7), q.shape)

    def attention(impl):
      return self.variant(functools.partial(causal_attention, window=window, implementation=impl))

    def loss(impl):
      return lambda q, k, v: jnp.sum(attention(impl)(q, k, v) * cot)

    assert_close(attention("xla")(q, k, v), attention("reference")(q, k, v))
    assert_close(
      jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v), jax.grad(loss("reference"), argnums=(0, 1, 2))(q, k, v)
    )


def test_reference_matches_softmax_definition_brute_force():
  q, k, v = _qkv(seed=3, batch=1, seq=5, heads=2, kv_heads=2, head_dim=4)
  out = causal_attention(q, k, v, implementation="reference")
  qn, kn, vn = (np.asarray(x, np.float64)[0] for x in (q, k, v))
  expected = np.zeros_like(qn)
  for h in range(2):
    for i in range(5):
      s = kn[: i + 1, h] @ qn[i, h] / 2.0
      p = np.exp(s - s.max())
      expected[i, h] = (p / p.sum()) @ vn[: i + 1, h]
  assert rel_err(out[0], expected) < 1e-6


def test_default_on_cpu_is_xla_and_cudnn_is_refused():
  q, k, v = _qkv(seed=4, dtype=jnp.bfloat16)
  out = causal_attention(q, k, v)
  ref = causal_attention(q, k, v, implementation="reference")
  assert rel_err(out.astype(jnp.float32), ref.astype(jnp.float32)) < 1e-2
  if jax.default_backend() != "gpu":
    with pytest.raises(ValueError, match="cudnn.*cannot run"):
      causal_attention(q, k, v, implementation="cudnn")


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(window=0), "window"),
    (dict(implementation="flash"), "causal_attention: unknown implementation .flash."),
  ],
)
def test_bad_arguments(bad, match):
  q, k, v = _qkv(seed=5)
  with pytest.raises(ValueError, match=match):
    causal_attention(q, k, v, **bad)


def test_bad_shapes():
  q, k, v = _qkv(seed=6, heads=4, kv_heads=2)
  with pytest.raises(ValueError, match="multiple of k/v heads"):
    causal_attention(q[:, :, :3], k, v)
  with pytest.raises(ValueError, match="same shape"):
    causal_attention(q, k, v[:, :5])
  with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
    causal_attention(q[0], k, v)
