"""What the power-attention tests share: small float32 inputs (grouped-query heads with
group 3, odd sizes) and the attention form from the definition, jitted (the oracle of the
chain of trust)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.ops.power import (
  PowerState,
  expand,
  power_attention_chunked,
  power_attention_log_space,
  power_attention_reference,
  reference_state,
)
from helpers import rel_err


# Sizes the Mosaic GPU kernels refuse (each a change to bf16 heads of 64 and chunks of 128),
# and a piece of the one-line reason (`pallas_kernels.power.mosaic_tiles.unsupported_reason`).
MOSAIC_BAD_SIZES = [
  (dict(dtype=jnp.float32), "16-bit operands"),
  (dict(head_dim=32), "head_dim in"),
  (dict(chunk=96), "multiple of 64"),
  (dict(stages=0), "stages must be"),
]

# batch, seq, q heads, kv heads, head_dim, value_dim: GQA with group 3, odd sizes.
B, T, HQ, HKV, D_HEAD, D_VALUE = 2, 11, 6, 2, 8, 6


def power_inputs(seed, seq=T, dtype=jnp.float32, gating=True):
  """q, k, v, log_g with log-gates in about [-2.4, -0.05] (per-token retention 0.1 .. 0.95).

  Drawn with numpy: no XLA compilation for the test data.
  """
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, seq, HQ, D_HEAD))
  k = rng.standard_normal((B, seq, HKV, D_HEAD))
  v = rng.standard_normal((B, seq, HKV, D_VALUE))
  log_g = -np.logaddexp(0.0, -(1.0 + 1.5 * rng.standard_normal((B, seq, HKV))))
  inputs = tuple(jnp.asarray(x.astype(np.float32), dtype) for x in (q, k, v))
  return (*inputs, jnp.asarray(log_g.astype(np.float32), dtype) if gating else None)


def tiny_weight_inputs(seed):
  """float32 power_inputs where two rows of p = 4 weights are tiny, as early in training:
  the first query nearly orthogonal to the first key (|scale q_0 . k_0| < 1e-5, its single
  weight < 1e-20) and the query at position 5 shrunk to norm ~1e-6 (its weights < 1e-21).
  Either sum of weights squares to 0 in float32 (below 5.4e-20, it does)."""
  q, k, v, log_g = power_inputs(seed)
  own_key = jnp.repeat(k[:, :1], HQ // HKV, axis=2)
  along = jnp.sum(q[:, :1] * own_key, -1, keepdims=True) / jnp.sum(own_key**2, -1, keepdims=True)
  q = q.at[:, :1].add(-(along - 1e-6) * own_key).at[:, 5].multiply(1e-6)
  return q, k, v, log_g


def definition(q, k, v, log_g, p):
  """y_i = sum_j w_ij v_j / sum_j w_ij, w_ij = (q_i . k_j / sqrt(d))^p e^{G_i - G_j}, term by
  term with nothing rescaled: an oracle for float64 only."""
  group = q.shape[2] // k.shape[2]
  k, v, cumulative = (jnp.repeat(x, group, axis=2) for x in (k, v, jnp.cumsum(log_g, axis=1)))
  scores = jnp.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
  g = jnp.moveaxis(cumulative, 1, -1)  # [B, H, T]
  causal = jnp.tril(jnp.ones((q.shape[1],) * 2, bool))
  weights = jnp.where(causal, scores**p * jnp.exp(jnp.where(causal, g[..., :, None] - g[..., None, :], 0.0)), 0.0)
  return jnp.einsum("bhij,bjhe->bihe", weights, v) / jnp.moveaxis(jnp.sum(weights, -1), -1, 1)[..., None]


def gradients(fn, inputs, seed):
  """Gradients of sum(fn(q, k, v, log_g) * c) w.r.t. q, k, v and log_g, c a fixed random cotangent."""
  cotangent = np.random.default_rng(seed).standard_normal(inputs[0].shape[:3] + (D_VALUE,))
  loss = lambda *a: jnp.sum(fn(*a) * jnp.asarray(cotangent, a[0].dtype))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*inputs)


def assert_gradients_match_definition(fn, inputs, p, tolerance):
  """fn's float32 gradients are finite and within `tolerance` (relative norm) of the
  definition's in float64, for each argument and for the first query alone (whose true
  gradient is 0: its output is the first value whatever the query)."""
  got = gradients(fn, inputs, seed=1)
  with jax.enable_x64(True):
    want = gradients(lambda *a: definition(*a, p=p), tuple(jnp.asarray(x, jnp.float64) for x in inputs), seed=1)
  for name, grad, expected in zip(("q", "k", "v", "log_g"), got, want):
    assert np.isfinite(np.asarray(grad)).all(), name
    assert rel_err(grad, expected) < tolerance, (name, rel_err(grad, expected))
  first = np.abs(np.asarray(got[0][:, 0])).max()
  assert first <= tolerance * np.abs(np.asarray(got[0][:, 1:])).max(), first


def split_tokens(inputs, start, stop):
  return tuple(None if x is None else x[:, start:stop] for x in inputs)


@functools.partial(jax.jit, static_argnames=("p", "expansion", "d_tile"))
def reference(q, k, v, log_g, p=2, expansion="spow", d_tile=None):
  out = power_attention_reference(q, k, v, log_g, p=p)
  return out, reference_state(k, v, log_g, p=p, expansion=expansion, d_tile=d_tile)


attention_form = jax.jit(power_attention_reference, static_argnames=("p", "scale"))


final_state_of = jax.jit(reference_state, static_argnames=("p",))


log_space = jax.jit(power_attention_log_space, static_argnames=("p", "eps"))


chunked = jax.jit(power_attention_chunked, static_argnames=("p", "chunk_size", "expansion", "d_tile"))


@functools.partial(jax.jit, static_argnums=(2, 3))
def expanded_inner_product(q, k, p, expansion):
  phi_q, phi_k = expand(q, p, expansion), expand(k, p, expansion)
  return jnp.sum(phi_q * phi_k, axis=-1), phi_q.shape[-1]


def loss_with_state(fn, cotangents):
  """sum(out * c_out) + sum(state * c_state) + sum(normalizer * c_norm): every output is differentiated."""

  def loss(q, k, v, log_g):
    out, state = fn(q, k, v, log_g)
    return (
      jnp.sum(out * cotangents[0]) + jnp.sum(state.state * cotangents[1]) + jnp.sum(state.normalizer * cotangents[2])
    )

  return loss


def bad_cases():
  q, k, v, log_g = power_inputs(seed=112)
  ok = dict(q=q, k=k, v=v, log_g=log_g)
  state = PowerState(jnp.zeros((B, HKV, 7, D_VALUE)), jnp.zeros((B, HKV, 7)))
  return [
    (dict(p=3), "p must be an even int >= 2"),
    (dict(p=0), "p must be an even int >= 2"),
    (dict(p=2.0), "p must be an even int"),
    (dict(q=q[..., :4]), "k has head_dim 8 but q has 4"),
    (dict(q=q[:, :, :5]), r"q heads \(5\) must be a multiple of k/v heads \(2\)"),
    (dict(v=v[:, :, :1]), "v has 1 heads but k has 2"),
    (dict(v=v[:, :5]), "must agree in batch and seq"),
    (dict(q=q[0]), r"q must have shape \[batch, seq, heads, head_dim\]"),
    (dict(k=k.astype(jnp.bfloat16)), "k has dtype bfloat16"),
    (dict(log_g=jnp.zeros((B, T, HQ))), r"log_g must have shape \[batch, seq, kv_heads\] = \(2, 11, 2\)"),
    (dict(chunk_size=0), "chunk_size must be"),
    (dict(chunk_size=2.5), "chunk_size must be"),
    (dict(expansion="sympow"), "Unknown expansion 'sympow'"),
    (dict(expansion="tspow", d_tile=3), r"d_tile \(3\) must divide the head dim \(8\)"),
    (dict(expansion="spow", d_tile=2), "d_tile=2 only applies to expansion='tspow'"),
    (dict(scale=0.0), "scale must be None"),
    (dict(implementation="flash"), "power_attention: unknown implementation 'flash'"),
    (dict(initial_state=state), r"initial_state.state has shape \(2, 2, 7, 6\), expected \(2, 2, 36, 6\)"),
    (dict(initial_state=(state.state, state.normalizer)), "initial_state must be a PowerState"),
  ], ok
