"""The chunked XLA path (`castle_jax.ops.power.xla`) against the attention form from the definition:
outputs, final states and the gradients of q, k, v and log_g, for every expansion, chunk sizes
that do not divide the length, an initial state, length one, bf16, causality, and memory linear
in the length.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import (
  decode_step,
  expanded_dim,
  init_cache,
  power_attention_chunked,
  power_attention_recurrent,
)
from helpers import rel_err
from ops.power.base import (
  B,
  D_HEAD,
  D_VALUE,
  HKV,
  HQ,
  T,
  assert_gradients_match_definition,
  attention_form,
  chunked,
  loss_with_state,
  power_inputs,
  reference,
  split_tokens,
  tiny_weight_inputs,
)


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


@pytest.mark.parametrize(
  "p, expansion, chunk_size, gating",
  [(2, "spow", 4, True), (2, "spow", 1, True), (2, "tpow", 3, False), (4, "tspow", 16, True)],
)
def test_chunked_matches_definition_float64(p, expansion, chunk_size, gating):
  with jax.enable_x64(True):
    inputs = power_inputs(seed=20 + chunk_size, dtype=jnp.float64, gating=gating)
    d_tile = 2 if expansion == "tspow" else None
    out, state = chunked(*inputs, p=p, chunk_size=chunk_size, expansion=expansion, d_tile=d_tile)
    expected, expected_state = reference(*inputs, p=p, expansion=expansion, d_tile=d_tile)
    assert out.dtype == jnp.float64 and state.state.dtype == jnp.float64
    assert rel_err(out, expected) < 1e-12
    assert rel_err(state.state, expected_state.state) < 1e-12
    assert rel_err(state.normalizer, expected_state.normalizer) < 1e-12


@pytest.mark.parametrize("p, chunk_size", [(2, 4), (4, 3)])
def test_chunked_matches_definition_float32(p, chunk_size):
  inputs = power_inputs(seed=30 + p)
  out, state = chunked(*inputs, p=p, chunk_size=chunk_size)
  expected, expected_state = reference(*inputs, p=p)
  assert out.shape == (B, T, HQ, D_VALUE) and out.dtype == jnp.float32
  assert state.state.shape == (B, HKV, expanded_dim(D_HEAD, p), D_VALUE)
  assert rel_err(out, expected) < 1e-5
  assert rel_err(state.state, expected_state.state) < 1e-5
  assert rel_err(state.normalizer, expected_state.normalizer) < 1e-5


def test_chunked_with_initial_state_continues_the_sequence():
  split, chunk_size = 4, 3
  inputs = power_inputs(seed=40)
  expected, expected_state = reference(*inputs)
  _, state = chunked(*split_tokens(inputs, 0, split), chunk_size=chunk_size)
  out, final = chunked(*split_tokens(inputs, split, T), chunk_size=chunk_size, initial_state=state)
  assert rel_err(out, expected[:, split:]) < 1e-5
  assert rel_err(final.state, expected_state.state) < 1e-5
  # The state matters: without it the continuation is a different function.
  assert rel_err(chunked(*split_tokens(inputs, split, T), chunk_size=chunk_size)[0], expected[:, split:]) > 1e-2


def test_length_one_outputs_the_value():
  inputs = power_inputs(seed=50, seq=1)
  expected = jnp.repeat(inputs[2], HQ // HKV, axis=2)  # one key: weight 1 on its value
  assert rel_err(attention_form(*inputs), expected) < 1e-6
  assert rel_err(chunked(*inputs, chunk_size=4)[0], expected) < 1e-6
  assert rel_err(power_attention_recurrent(*inputs)[0], expected) < 1e-5
  # A query almost orthogonal to the key: phi(q) . phi(k) = (q . k)^p ~ 1e-12 is a sum of
  # terms ~1, which float32 cannot resolve; every path must compute the weight directly.
  q, k, v, log_g = inputs
  k_per_q = jnp.repeat(k, HQ // HKV, axis=2)
  q = q - (jnp.sum(q * k_per_q, -1, keepdims=True) / jnp.sum(k_per_q**2, -1, keepdims=True) - 1e-6) * k_per_q
  for out in (
    chunked(q, k, v, log_g, chunk_size=4)[0],
    power_attention_recurrent(q, k, v, log_g)[0],
    decode_step(init_cache(B, HKV, D_HEAD, D_VALUE), q, k, v, log_g)[0],
  ):
    assert rel_err(out, expected) < 1e-5


def test_chunked_bf16_inputs():
  inputs = power_inputs(seed=51, dtype=jnp.bfloat16)
  out, state = chunked(*inputs, chunk_size=4)
  assert out.dtype == jnp.bfloat16 and state.state.dtype == jnp.float32
  expected, expected_state = reference(*(x.astype(jnp.float32) for x in inputs))
  assert rel_err(out.astype(jnp.float32), expected) < 1e-2
  assert rel_err(state.state, expected_state.state) < 1e-2


@pytest.mark.parametrize("p, chunk_size", [(2, 4), (4, 3)])
def test_gradients_match_definition(p, chunk_size):
  inputs = power_inputs(seed=60 + p)
  dim = expanded_dim(D_HEAD, p)
  rng = np.random.default_rng(61)
  cotangents = tuple(
    jnp.asarray(rng.standard_normal(shape) / scale, jnp.float32)
    for shape, scale in [((B, T, HQ, D_VALUE), 1.0), ((B, HKV, dim, D_VALUE), dim), ((B, HKV, dim), dim)]
  )
  grad = lambda fn: jax.jit(jax.grad(loss_with_state(fn, cotangents), argnums=(0, 1, 2, 3)))(*inputs)
  expected = grad(lambda *a: reference(*a, p=p))
  fast_paths = {"chunked": functools.partial(power_attention_chunked, p=p, chunk_size=chunk_size)}
  if p == 2:
    fast_paths["recurrent"] = functools.partial(power_attention_recurrent, p=p)
  # Earlier chunks reach a query through phi(q) . S, a sum of D signed terms as large as
  # (sum_i |q_i k_i|)^p for a weight (q . k)^p: float32 keeps fewer digits for p = 4
  # (worst over 25 random seeds: 9e-6 here, 3e-5 for the outputs of token-by-token decoding).
  tolerance = 1e-5 if p == 2 else 3e-5
  for path, fast in fast_paths.items():
    for name, got, want in zip(("q", "k", "v", "log_g"), grad(fast), expected):
      assert rel_err(got, want) < tolerance, (path, name)


@pytest.mark.parametrize("path", ["chunked", "recurrent"])
def test_gradients_where_the_weights_are_tiny(path):
  """As the oracle's test of that name: the chunked form (the first query in a chunk with
  no state, the small one in a chunk with one) and token-by-token decoding."""
  fast = {
    "chunked": lambda *a: power_attention_chunked(*a, p=4, chunk_size=3)[0],
    "recurrent": lambda *a: power_attention_recurrent(*a, p=4)[0],
  }[path]
  # Decoding reads every earlier key through phi(q) . S (see test_gradients_match_definition).
  assert_gradients_match_definition(fast, tiny_weight_inputs(seed=13), 4, 3e-5 if path == "chunked" else 2e-4)


def test_chunked_is_causal():
  inputs = power_inputs(seed=70)
  last_kept = 5
  future = jnp.arange(T) > last_kept
  noise = power_inputs(seed=71)
  perturbed = tuple(
    x + jnp.where(future.reshape((1, T) + (1,) * (x.ndim - 2)), 3.0 * n, 0.0) for x, n in zip(inputs, noise)
  )
  out, _ = chunked(*inputs, chunk_size=4)
  out_perturbed, _ = chunked(*perturbed, chunk_size=4)
  np.testing.assert_array_equal(out[:, : last_kept + 1], out_perturbed[:, : last_kept + 1])
  assert rel_err(out_perturbed[:, last_kept + 1 :], out[:, last_kept + 1 :]) > 1e-2


def test_chunked_memory_is_linear_in_length():
  """The gradient program stores per-chunk states, not phi(K) for every token."""
  head_dim, chunk = 32, 64
  dim = expanded_dim(head_dim, 2)

  def temp_bytes(seq):
    qkv = jax.ShapeDtypeStruct((1, seq, 1, head_dim), jnp.float32)
    gates = jax.ShapeDtypeStruct((1, seq, 1), jnp.float32)
    loss = lambda *a: jnp.sum(power_attention_chunked(*a, chunk_size=chunk)[0])
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(qkv, qkv, qkv, gates).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(2048), temp_bytes(4096)
  assert large < 2.5 * small
  # Less than one phi(K) of the whole sequence (without jax.checkpoint: ~10x more).
  assert large < 4096 * dim * 4
