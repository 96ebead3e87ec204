"""Power attention math: expansions -> attention form -> chunked form -> recurrent decoding.

Chain of trust: the expansions satisfy phi(q) . phi(k) = (q . k)^p (float64, Table 3
dimensions); the attention form from the definition checks the paper's log-space
form, the chunked form (outputs, final states and the gradients of q, k, v, log_g),
the token-by-token recurrence and prefill + decoding with a cache. Shapes use
grouped-query heads, a sequence length (11) that is no multiple of the chunk sizes,
and length 1.
"""

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import (
  PowerState,
  append_tokens,
  decode_step,
  expand,
  expanded_dim,
  init_cache,
  power_attention,
  power_attention_chunked,
  power_attention_log_space,
  power_attention_recurrent,
  power_attention_reference,
  prefill,
  reference_state,
  spow,
  tpow,
  tspow,
)
from castle_jax.ops.power.expansion import expansion_table
from helpers import rel_err

# batch, seq, q heads, kv heads, head_dim, value_dim: GQA with group 3, odd sizes.
B, T, HQ, HKV, D_HEAD, D_VALUE = 2, 11, 6, 2, 8, 6


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _inputs(seed, seq=T, dtype=jnp.float32, gating=True):
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


def _split(inputs, start, stop):
  return tuple(None if x is None else x[:, start:stop] for x in inputs)


@functools.partial(jax.jit, static_argnames=("p", "expansion", "d_tile"))
def _reference(q, k, v, log_g, p=2, expansion="spow", d_tile=None):
  out = power_attention_reference(q, k, v, log_g, p=p)
  return out, reference_state(k, v, log_g, p=p, expansion=expansion, d_tile=d_tile)


_attention_form = jax.jit(power_attention_reference, static_argnames=("p", "scale"))
_state = jax.jit(reference_state, static_argnames=("p",))
_log_space = jax.jit(power_attention_log_space, static_argnames=("p", "eps"))
_chunked = jax.jit(power_attention_chunked, static_argnames=("p", "chunk_size", "expansion", "d_tile"))


# --- expansions -------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(2, 3))
def _expanded_inner_product(q, k, p, expansion):
  phi_q, phi_k = expand(q, p, expansion), expand(k, p, expansion)
  return jnp.sum(phi_q * phi_k, axis=-1), phi_q.shape[-1]


@pytest.mark.parametrize("head_dim", [4, 8, 64])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("expansion", ["tpow", "spow", "tspow"])
def test_expansion_inner_product_is_the_power_float64(head_dim, p, expansion):
  if expansion == "tpow" and head_dim**p > 10**6:
    pytest.skip("tpow of d=64, p=4 has 16.7M dimensions")
  with jax.enable_x64(True):
    q, k = jnp.asarray(np.random.default_rng(head_dim + p).standard_normal((2, 3, head_dim)))
    inner, dim = _expanded_inner_product(q, k, p, expansion)
    assert dim == expanded_dim(head_dim, p, expansion)
    expected = np.sum(np.asarray(q) * np.asarray(k), axis=-1) ** p
    assert rel_err(inner, expected) < 1e-13


def test_dimensions_match_table3():
  # Table 3 of the paper: d = 64, p = 2 .. 6.
  table3 = {
    2: (4096, 2080),
    3: (262144, 45760),
    4: (16777216, 766480),
    5: (1073741824, 10424128),
    6: (68719476736, 119877472),
  }
  for p, (tpow_dim, spow_dim) in table3.items():
    assert expanded_dim(64, p, "tpow") == tpow_dim
    assert expanded_dim(64, p, "spow") == spow_dim
  # tspow: C(d / d_tile + p - 1, p) * d_tile^p (Sec. 4.1.1).
  assert expanded_dim(64, 2, "tspow", 8) == math.comb(9, 2) * 64 == 2304
  assert expanded_dim(64, 3, "tspow", 4) == math.comb(18, 3) * 64
  for head_dim, p, expansion, d_tile in [
    (8, 2, "spow", None),
    (8, 4, "spow", None),
    (8, 3, "tpow", None),
    (8, 2, "tspow", 2),
    (12, 4, "tspow", 3),
  ]:
    idx, weights = expansion_table(head_dim, p, expansion, d_tile)
    assert idx.shape == (expanded_dim(head_dim, p, expansion, d_tile), p) and weights.shape == idx.shape[:1]


def test_spow_matches_the_papers_examples():
  with jax.enable_x64(True):
    x1, x2 = 1.5, -0.7
    x = jnp.array([x1, x2])
    np.testing.assert_allclose(spow(x, 2), [x1 * x1, math.sqrt(2) * x1 * x2, x2 * x2], rtol=1e-15)
    np.testing.assert_allclose(
      spow(x, 3), [x1**3, math.sqrt(3) * x1 * x1 * x2, math.sqrt(3) * x1 * x2 * x2, x2**3], rtol=1e-15
    )


def test_tspow_interpolates_between_spow_and_tpow():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8)))
    np.testing.assert_array_equal(tspow(x, 2, d_tile=1), spow(x, 2))
    np.testing.assert_array_equal(tspow(x, 3, d_tile=8), tpow(x, 3))
    # Unweighted symmetric entries break the identity: the weights are needed.
    idx, _ = expansion_table(8, 2, "spow")
    unweighted = jnp.prod(x[..., idx], axis=-1)
    assert rel_err(jnp.sum(unweighted[0] * unweighted[1]), jnp.sum(x[0] * x[1]) ** 2) > 1e-2


# --- attention form -----------------------------------------------------------------


@pytest.mark.parametrize("p, gating", [(2, True), (4, True), (2, False)])
def test_log_space_form_matches_definition_float64(p, gating):
  with jax.enable_x64(True):
    inputs = _inputs(seed=10 + p, dtype=jnp.float64, gating=gating)
    expected = _attention_form(*inputs, p=p)
    assert rel_err(_log_space(*inputs, p=p, eps=0.0), expected) < 1e-12
    # The paper's eps = 1e-7 moves the weights by a relative p * eps / |s|.
    assert rel_err(_log_space(*inputs, p=p), expected) < 1e-5


def test_reference_continues_from_a_state_float64():
  """The attention form with an initial state equals the same rows of the longer sequence."""
  with jax.enable_x64(True):
    inputs = _inputs(seed=11, dtype=jnp.float64)
    full = _attention_form(*inputs, p=2)
    state = _state(*_split(inputs, 0, 4)[1:], p=2)
    rest = _attention_form(*_split(inputs, 4, T), p=2, initial_state=state)
    assert rel_err(rest, full[:, 4:]) < 1e-12
    both = _state(*_split(inputs, 4, T)[1:], p=2, initial_state=state)
    whole = _state(*inputs[1:], p=2)
    assert rel_err(both.state, whole.state) < 1e-12 and rel_err(both.normalizer, whole.normalizer) < 1e-12


def test_outputs_are_the_weighted_mean_computed_by_hand():
  with jax.enable_x64(True):
    q, k, v, log_g = (np.asarray(x, np.float64) for x in _inputs(seed=12, seq=5, dtype=jnp.float64))
    out = np.asarray(_attention_form(q, k, v, log_g, p=4, scale=0.3))
    b, i, h = 1, 4, 4
    kv_head = h // (HQ // HKV)
    weights = np.array(
      [
        (0.3 * q[b, i, h] @ k[b, j, kv_head]) ** 4 * np.exp(log_g[b, j + 1 : i + 1, kv_head].sum())
        for j in range(i + 1)
      ]
    )
    expected = weights @ v[b, : i + 1, kv_head] / weights.sum()
    assert rel_err(out[b, i, h], expected) < 1e-13


# --- chunked form -------------------------------------------------------------------


@pytest.mark.parametrize(
  "p, expansion, chunk_size, gating",
  [(2, "spow", 4, True), (2, "spow", 1, True), (2, "tpow", 3, False), (4, "tspow", 16, True)],
)
def test_chunked_matches_definition_float64(p, expansion, chunk_size, gating):
  with jax.enable_x64(True):
    inputs = _inputs(seed=20 + chunk_size, dtype=jnp.float64, gating=gating)
    d_tile = 2 if expansion == "tspow" else None
    out, state = _chunked(*inputs, p=p, chunk_size=chunk_size, expansion=expansion, d_tile=d_tile)
    expected, expected_state = _reference(*inputs, p=p, expansion=expansion, d_tile=d_tile)
    assert out.dtype == jnp.float64 and state.state.dtype == jnp.float64
    assert rel_err(out, expected) < 1e-12
    assert rel_err(state.state, expected_state.state) < 1e-12
    assert rel_err(state.normalizer, expected_state.normalizer) < 1e-12


@pytest.mark.parametrize("p, chunk_size", [(2, 4), (4, 3)])
def test_chunked_matches_definition_float32(p, chunk_size):
  inputs = _inputs(seed=30 + p)
  out, state = _chunked(*inputs, p=p, chunk_size=chunk_size)
  expected, expected_state = _reference(*inputs, p=p)
  assert out.shape == (B, T, HQ, D_VALUE) and out.dtype == jnp.float32
  assert state.state.shape == (B, HKV, expanded_dim(D_HEAD, p), D_VALUE)
  assert rel_err(out, expected) < 1e-5
  assert rel_err(state.state, expected_state.state) < 1e-5
  assert rel_err(state.normalizer, expected_state.normalizer) < 1e-5


def test_chunked_with_initial_state_continues_the_sequence():
  split, chunk_size = 4, 3
  inputs = _inputs(seed=40)
  expected, expected_state = _reference(*inputs)
  _, state = _chunked(*_split(inputs, 0, split), chunk_size=chunk_size)
  out, final = _chunked(*_split(inputs, split, T), chunk_size=chunk_size, initial_state=state)
  assert rel_err(out, expected[:, split:]) < 1e-5
  assert rel_err(final.state, expected_state.state) < 1e-5
  # The state matters: without it the continuation is a different function.
  assert rel_err(_chunked(*_split(inputs, split, T), chunk_size=chunk_size)[0], expected[:, split:]) > 1e-2


def test_length_one_outputs_the_value():
  inputs = _inputs(seed=50, seq=1)
  expected = jnp.repeat(inputs[2], HQ // HKV, axis=2)  # one key: weight 1 on its value
  assert rel_err(_attention_form(*inputs), expected) < 1e-6
  assert rel_err(_chunked(*inputs, chunk_size=4)[0], expected) < 1e-6
  assert rel_err(power_attention_recurrent(*inputs)[0], expected) < 1e-5
  # A query almost orthogonal to the key: phi(q) . phi(k) = (q . k)^p ~ 1e-12 is a sum of
  # terms ~1, which float32 cannot resolve; every path must compute the weight directly.
  q, k, v, log_g = inputs
  k_per_q = jnp.repeat(k, HQ // HKV, axis=2)
  q = q - (jnp.sum(q * k_per_q, -1, keepdims=True) / jnp.sum(k_per_q**2, -1, keepdims=True) - 1e-6) * k_per_q
  for out in (
    _chunked(q, k, v, log_g, chunk_size=4)[0],
    power_attention_recurrent(q, k, v, log_g)[0],
    decode_step(init_cache(B, HKV, D_HEAD, D_VALUE), q, k, v, log_g)[0],
  ):
    assert rel_err(out, expected) < 1e-5


def test_chunked_bf16_inputs():
  inputs = _inputs(seed=51, dtype=jnp.bfloat16)
  out, state = _chunked(*inputs, chunk_size=4)
  assert out.dtype == jnp.bfloat16 and state.state.dtype == jnp.float32
  expected, expected_state = _reference(*(x.astype(jnp.float32) for x in inputs))
  assert rel_err(out.astype(jnp.float32), expected) < 1e-2
  assert rel_err(state.state, expected_state.state) < 1e-2


def _loss_with_state(fn, cotangents):
  """sum(out * c_out) + sum(state * c_state) + sum(normalizer * c_norm): every output is differentiated."""

  def loss(q, k, v, log_g):
    out, state = fn(q, k, v, log_g)
    return (
      jnp.sum(out * cotangents[0]) + jnp.sum(state.state * cotangents[1]) + jnp.sum(state.normalizer * cotangents[2])
    )

  return loss


@pytest.mark.parametrize("p, chunk_size", [(2, 4), (4, 3)])
def test_gradients_match_definition(p, chunk_size):
  inputs = _inputs(seed=60 + p)
  dim = expanded_dim(D_HEAD, p)
  rng = np.random.default_rng(61)
  cotangents = tuple(
    jnp.asarray(rng.standard_normal(shape) / scale, jnp.float32)
    for shape, scale in [((B, T, HQ, D_VALUE), 1.0), ((B, HKV, dim, D_VALUE), dim), ((B, HKV, dim), dim)]
  )
  grad = lambda fn: jax.jit(jax.grad(_loss_with_state(fn, cotangents), argnums=(0, 1, 2, 3)))(*inputs)
  expected = grad(lambda *a: _reference(*a, p=p))
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


def test_chunked_is_causal():
  inputs = _inputs(seed=70)
  last_kept = 5
  future = jnp.arange(T) > last_kept
  noise = _inputs(seed=71)
  perturbed = tuple(
    x + jnp.where(future.reshape((1, T) + (1,) * (x.ndim - 2)), 3.0 * n, 0.0) for x, n in zip(inputs, noise)
  )
  out, _ = _chunked(*inputs, chunk_size=4)
  out_perturbed, _ = _chunked(*perturbed, chunk_size=4)
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


# --- recurrent decoding -----------------------------------------------------------------


@pytest.mark.parametrize("p, expansion", [(2, "spow"), (4, "tspow")])
def test_recurrent_matches_definition_float64(p, expansion):
  with jax.enable_x64(True):
    inputs = _inputs(seed=80 + p, dtype=jnp.float64)
    out, state = jax.jit(power_attention_recurrent, static_argnames=("p", "expansion"))(
      *inputs, p=p, expansion=expansion
    )
    expected, expected_state = _reference(*inputs, p=p, expansion=expansion)
    assert rel_err(out, expected) < 1e-12
    assert rel_err(state.state, expected_state.state) < 1e-12
    assert rel_err(state.normalizer, expected_state.normalizer) < 1e-12


@pytest.mark.parametrize("prompt_len, gating", [(5, True), (11, False)])
def test_prefill_then_decode_matches_definition(prompt_len, gating):
  inputs = _inputs(seed=90 + prompt_len, gating=gating)
  expected, expected_state = _reference(*inputs)
  cache = init_cache(B, HKV, D_HEAD, D_VALUE)
  assert cache.state.shape == (B, HKV, expanded_dim(D_HEAD, 2), D_VALUE) and cache.state.dtype == jnp.float32
  out, cache = jax.jit(prefill, static_argnames="chunk_size")(cache, *_split(inputs, 0, prompt_len), chunk_size=2)
  outs = [out]
  step = jax.jit(decode_step)
  for t in range(prompt_len, min(prompt_len + 3, T)):
    out, cache = step(cache, *_split(inputs, t, t + 1))
    outs.append(out)
  done = min(prompt_len + 3, T)
  if done < T:  # then the rest in one piece on the non-empty cache
    out, cache = jax.jit(append_tokens, static_argnames="chunk_size")(cache, *_split(inputs, done, T), chunk_size=4)
    outs.append(out)
  assert int(cache.length) == T
  assert rel_err(jnp.concatenate(outs, axis=1), expected) < 1e-5
  assert rel_err(cache.state, expected_state.state) < 1e-5
  assert rel_err(cache.normalizer, expected_state.normalizer) < 1e-5


def test_decoding_memory_is_constant_in_length():
  cache = init_cache(B, HKV, D_HEAD, D_VALUE)
  shapes = [
    jax.tree.map(lambda x: x.shape, jax.eval_shape(append_tokens, cache, *_inputs(seed=95, seq=seq))[1])
    for seq in (1, 64, 1000)
  ]
  assert shapes[0] == shapes[1] == shapes[2] == jax.tree.map(lambda x: x.shape, cache)


# --- the tests can fail -------------------------------------------------------------------


def test_gating_and_power_change_the_outputs_and_scale_cancels():
  inputs = _inputs(seed=100)
  base = _attention_form(*inputs)
  assert rel_err(_attention_form(*inputs[:3]), base) > 1e-2  # no gates
  assert rel_err(_attention_form(*inputs, p=4), base) > 1e-2
  # The scale multiplies every weight by scale^p, which the normalization divides out:
  # it only moves the numbers' magnitude (overflow, and eps in the log-space form).
  assert rel_err(_attention_form(*inputs, scale=1.0), base) < 1e-6
  # The chunked form with one chunk never meets its state path; a misplaced state
  # discount shows when it does.
  q, k, v, log_g = inputs
  shifted = jnp.concatenate([log_g[:, 1:], log_g[:, :1]], axis=1)
  assert rel_err(_chunked(q, k, v, shifted, chunk_size=4)[0], base) > 1e-3


# --- public entry point and bad input --------------------------------------------------------


def test_default_implementation_is_xla_and_logged(caplog):
  inputs = _inputs(seed=110)
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    out, state = jax.jit(functools.partial(power_attention, chunk_size=4, return_final_state=True))(*inputs)
  assert "xla" in caplog.text
  expected, expected_state = jax.jit(
    functools.partial(power_attention, implementation="reference", return_final_state=True)
  )(*inputs)
  assert rel_err(out, expected) < 1e-5 and rel_err(state.state, expected_state.state) < 1e-5


def _bad_cases():
  q, k, v, log_g = _inputs(seed=112)
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


@pytest.mark.parametrize("case", range(len(_bad_cases()[0])))
def test_bad_input_is_reported(case):
  cases, ok = _bad_cases()
  overrides, match = cases[case]
  arrays = {name: overrides.pop(name, ok[name]) for name in ("q", "k", "v", "log_g")}
  with pytest.raises(ValueError, match=match):
    power_attention(arrays["q"], arrays["k"], arrays["v"], arrays["log_g"], **overrides)


def test_bad_cache_input_is_reported():
  inputs = _inputs(seed=113)
  cache = init_cache(B, HKV, D_HEAD, D_VALUE, p=4)
  with pytest.raises(ValueError, match="initial_state.state has shape"):
    append_tokens(cache, *inputs, p=2)  # a p=4 cache fed as p=2
  with pytest.raises(ValueError, match="decode_step takes one token"):
    decode_step(init_cache(B, HKV, D_HEAD, D_VALUE), *inputs)
