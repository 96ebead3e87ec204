"""CASTLE math: recurrent definition <-> parallel form <-> blockwise <-> UQ-KV decoding.

Chain of trust: the recurrent definition (Eqs. 2-7) checks the parallel form
(Theorem 1) in float64; the parallel form checks the blockwise path (outputs and all
six gradients) and the decode path; the cache is checked against U^t recomputed from
the definition at every step.
"""

import functools
import logging

from absl.testing import parameterized
import chex
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import (
  castle_attention,
  castle_blockwise,
  castle_parallel,
  castle_recurrent,
  decode_step,
  init_cache,
  lookahead_keys,
  prefill,
)
from castle_jax.ops.castle.reference import lookahead_scores_parallel
from helpers import rel_err

# batch, seq, heads, head_dim: seq and heads are not powers of two, and seq is not a
# multiple of the block sizes used below.
SHAPE = (2, 11, 3, 8)
WINDOWS = [None, 1, 3, 30]  # 30 > seq: SWL that never bites.


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _inputs(seed, shape=SHAPE, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 6)
  return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys)


def _recurrent(inputs, window):
  return jax.jit(castle_recurrent, static_argnames="window")(*inputs, window=window)


def _parallel(inputs, window):
  return jax.jit(castle_parallel, static_argnames="window")(*inputs, window=window)


def _blockwise(inputs, window, block_size):
  fn = jax.jit(castle_blockwise, static_argnames=("window", "block_size"))
  return fn(*inputs, window=window, block_size=block_size)


# --- recurrent definition <-> parallel form ---------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
def test_parallel_form_matches_recurrent_definition_float64(window):
  with jax.enable_x64(True):
    inputs = _inputs(seed=1 + (window or 0), dtype=jnp.float64)
    out = _parallel(inputs, window)
    expected = _recurrent(inputs, window)
    assert out.dtype == jnp.float64
    assert rel_err(out, expected) < 1e-12


def test_lookahead_keys_match_brute_force_sum():
  """Eq. (2) against u_s^t = sum_{s<j<=min(t, s+W)} sigmoid(q_s.k_j/sqrt(d)) v_j, by hand."""
  q_u, k_u, v_u = (np.asarray(x, np.float64) for x in _inputs(seed=2, shape=(1, 6, 1, 4))[:3])
  t, window = 5, 2
  keys = np.asarray(lookahead_keys(q_u, k_u, v_u, t, window=window))[0, :, 0]
  expected = np.zeros((t, 4))
  for s in range(t):
    for j in range(s + 1, min(t - 1, s + window) + 1):
      expected[s] += v_u[0, j, 0] / (1.0 + np.exp(-q_u[0, s, 0] @ k_u[0, j, 0] / 2.0))
  assert np.all(keys[-1] == 0)
  assert rel_err(keys, expected) < 1e-6


# --- blockwise <-> parallel ---------------------------------------------------------


@pytest.mark.parametrize("block_size, window", [(4, None), (5, 3), (1, None), (3, 1), (16, None), (4, 30), (2, 6)])
def test_blockwise_matches_parallel_float32(block_size, window):
  inputs = _inputs(seed=10 + block_size)
  out = _blockwise(inputs, window, block_size)
  assert out.shape == SHAPE and out.dtype == jnp.float32
  assert rel_err(out, _parallel(inputs, window)) < 1e-5


@pytest.mark.parametrize("window", [None, 2])
def test_blockwise_matches_recurrent_float64(window):
  with jax.enable_x64(True):
    inputs = _inputs(seed=20, dtype=jnp.float64)
    out = _blockwise(inputs, window, 4)
    assert out.dtype == jnp.float64
    assert rel_err(out, _recurrent(inputs, window)) < 1e-12


def test_length_one():
  inputs = _inputs(seed=21, shape=(2, 1, 3, 8))
  expected = _recurrent(inputs, None)
  # One token: the output is v^C_1 whatever the scores.
  assert rel_err(expected, inputs[5]) < 1e-6
  assert rel_err(_blockwise(inputs, None, 4), expected) < 1e-6
  assert rel_err(_parallel(inputs, 3), expected) < 1e-6


@pytest.mark.parametrize("window", [None, 3])
def test_blockwise_bf16_inputs(window):
  inputs = _inputs(seed=22, dtype=jnp.bfloat16)
  out = _blockwise(inputs, window, 4)
  assert out.dtype == jnp.bfloat16
  expected = _parallel(tuple(x.astype(jnp.float32) for x in inputs), window)
  assert rel_err(out.astype(jnp.float32), expected) < 1e-2


@pytest.mark.parametrize("block_size, window", [(4, None), (5, 3), (1, 2)])
def test_blockwise_gradients_match_parallel_autodiff(block_size, window):
  inputs = _inputs(seed=30 + block_size)
  cotangent = jax.random.normal(jax.random.key(31), SHAPE)

  def loss(fn):
    return lambda *args: jnp.sum(fn(*args) * cotangent)

  grad_fn = functools.partial(jax.grad, argnums=tuple(range(6)))
  expected = jax.jit(grad_fn(loss(functools.partial(castle_parallel, window=window))))(*inputs)
  grads = jax.jit(grad_fn(loss(functools.partial(castle_blockwise, window=window, block_size=block_size))))(*inputs)
  for name, grad, ref in zip(("q_u", "k_u", "v_u", "q_c", "k_c", "v_c"), grads, expected):
    assert rel_err(grad, ref) < 1e-5, name


def test_blockwise_gradient_at_length_one():
  inputs = _inputs(seed=32, shape=(1, 1, 2, 8))
  grads = jax.grad(lambda *a: jnp.sum(castle_blockwise(*a) ** 2), argnums=tuple(range(6)))(*inputs)
  # o_1 = v^C_1 whatever the scores, so only v^C gets a gradient (up to rounding in
  # dP - Delta, which computes dO . v^C twice).
  for grad in grads[:5]:
    assert np.max(np.abs(np.asarray(grad))) < 1e-5
  assert rel_err(grads[5], 2 * inputs[5]) < 1e-6


@pytest.mark.parametrize("window", [None, 2])
def test_blockwise_is_causal(window):
  inputs = _inputs(seed=40)
  last_kept = 5
  noise = _inputs(seed=41)
  future = (jnp.arange(SHAPE[1]) > last_kept)[None, :, None, None]
  perturbed = tuple(x + jnp.where(future, 100.0 * n, 0.0) for x, n in zip(inputs, noise))
  out = _blockwise(inputs, window, 4)
  out_perturbed = _blockwise(perturbed, window, 4)
  np.testing.assert_array_equal(out[:, : last_kept + 1], out_perturbed[:, : last_kept + 1])
  assert rel_err(out_perturbed[:, last_kept + 1 :], out[:, last_kept + 1 :]) > 1e-2


def test_blockwise_memory_is_linear_in_length():
  """The gradient program holds no [T, T] array and its scratch grows ~linearly in T."""

  def compiled(seq):
    spec = jax.ShapeDtypeStruct((1, seq, 1, 16), jnp.float32)
    grad = jax.grad(lambda *a: jnp.sum(castle_blockwise(*a, block_size=32)), argnums=tuple(range(6)))
    return jax.jit(grad).lower(*[spec] * 6).compile()

  small, large = compiled(2048), compiled(4096)
  temp_small = small.memory_analysis().temp_size_in_bytes
  temp_large = large.memory_analysis().temp_size_in_bytes
  assert temp_large < 2.5 * temp_small
  assert temp_large < 4096 * 4096 * 4 / 4  # a quarter of one [T, T] float32 array
  assert "4096,4096]" not in large.as_text()


# --- UQ-KV cache decoding -----------------------------------------------------------


class DecodeFromEmptyCacheTest(chex.TestCase):
  """Token-by-token decoding: outputs vs the recurrent form, cache U vs U^t from Eq. (2);
  with and without jit (chex variants), since the step checks a concrete cache length
  eagerly and a traced one under jit."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters(None, 1, 3)  # window > capacity: see the prefill test.
  def test_matches_definition(self, window):
    with jax.enable_x64(True):
      inputs = _inputs(seed=50 + (window or 0), dtype=jnp.float64)
      seq = SHAPE[1]
      expected = _recurrent(inputs, window)
      cache = init_cache(SHAPE[0], seq + 2, SHAPE[2], SHAPE[3], jnp.float64, window=window)
      step = self.variant(decode_step)
      for t in range(seq):
        out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
        assert int(cache.length) == t + 1
        assert rel_err(out, expected[:, t : t + 1]) < 1e-12, t
        keys_t = lookahead_keys(*inputs[:3], t + 1, window=window)
        assert rel_err(cache.lookahead_keys[:, : t + 1], keys_t) < 1e-12, t
        assert np.all(np.asarray(cache.lookahead_keys[:, t + 1 :]) == 0)


@pytest.mark.parametrize("window, prompt_len", [(None, 4), (3, 6), (30, 4), (2, 1), (None, 11)])
def test_prefill_then_decode_matches_parallel(window, prompt_len):
  inputs = _inputs(seed=60 + prompt_len)
  batch, seq, heads, head_dim = SHAPE
  expected = _parallel(inputs, window)
  cache = init_cache(batch, seq, heads, head_dim, jnp.float32, window=window)
  if window is not None:
    assert cache.lookahead_queries.shape[1] == min(window, seq)
  out, cache = jax.jit(prefill, static_argnames="block_size")(cache, *(x[:, :prompt_len] for x in inputs), block_size=4)
  assert rel_err(out, expected[:, :prompt_len]) < 1e-5
  keys = lookahead_keys(*inputs[:3], prompt_len, window=window)
  assert rel_err(cache.lookahead_keys[:, :prompt_len], keys) < 1e-5
  step = jax.jit(decode_step)
  for t in range(prompt_len, seq):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    assert rel_err(out, expected[:, t : t + 1]) < 1e-5, t
  assert rel_err(cache.lookahead_keys, lookahead_keys(*inputs[:3], seq, window=window)) < 1e-5


def test_decode_ignores_poisoned_empty_slots():
  """NaN in slots the cache has not written yet must not reach the outputs."""
  inputs = _inputs(seed=70)
  batch, seq, heads, head_dim = SHAPE
  window = 3
  prompt_len = 4
  cache = init_cache(batch, seq + 3, heads, head_dim, jnp.float32, window=window)
  _, cache = prefill(cache, *(x[:, :prompt_len] for x in inputs))
  empty = (jnp.arange(cache.capacity) >= prompt_len)[None, :, None, None]
  cache = cache.replace(
    **{
      name: jnp.where(empty, jnp.nan, getattr(cache, name))
      for name in ("lookahead_keys", "causal_keys", "causal_values")
    }
  )
  expected = _parallel(inputs, window)
  step = jax.jit(decode_step)
  for t in range(prompt_len, seq):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    assert rel_err(out, expected[:, t : t + 1]) < 1e-5, t


def test_decode_bf16_cache_and_inputs():
  inputs = _inputs(seed=71, dtype=jnp.bfloat16)
  batch, seq, heads, head_dim = SHAPE
  expected = _parallel(tuple(x.astype(jnp.float32) for x in inputs), None)
  cache = init_cache(batch, seq, heads, head_dim, jnp.bfloat16)
  out, cache = prefill(cache, *(x[:, :5] for x in inputs))
  outs = [out]
  step = jax.jit(decode_step)
  for t in range(5, seq):
    out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
    outs.append(out)
  out = jnp.concatenate(outs, axis=1)
  assert out.dtype == jnp.bfloat16 and cache.lookahead_keys.dtype == jnp.bfloat16
  assert rel_err(out.astype(jnp.float32), expected) < 1e-2


# --- the tests can fail -------------------------------------------------------------


def test_lookahead_score_uses_the_causal_query():
  """Scoring lookahead keys with q^U (Eq. 5 / Alg. 4 line 10 as printed) gives other outputs."""
  with jax.enable_x64(True):
    inputs = _inputs(seed=80, dtype=jnp.float64)
    q_u, k_u, v_u, q_c, k_c, v_c = inputs
    correct = _recurrent(inputs, None)
    scale = 1.0 / np.sqrt(SHAPE[3])
    # The same parallel form, but S^U built from q^U.
    wrong_lookahead = lookahead_scores_parallel(q_u, k_u, v_u, q_u)
    causal_scores = jnp.einsum("bthd,bshd->bhts", q_c, k_c) * scale
    positions = jnp.arange(SHAPE[1])
    scores = causal_scores - jax.nn.silu(wrong_lookahead)
    scores = jnp.where(positions[:, None] >= positions[None, :], scores, -jnp.inf)
    wrong = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v_c)
    assert rel_err(wrong, correct) > 1e-2
    # The lookahead keys matter at all: plain causal attention differs as well.
    plain = jax.nn.dot_product_attention(q_c, k_c, v_c, is_causal=True)
    assert rel_err(plain, correct) > 1e-2
    # And so does the window.
    assert rel_err(_recurrent(inputs, 2), correct) > 1e-3


# --- public entry point and bad input -----------------------------------------------


def test_default_implementation_is_xla_and_logged(caplog):
  inputs = _inputs(seed=90)
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    out = castle_attention(*inputs, window=3, block_size=4)
  assert "xla" in caplog.text
  assert rel_err(out, castle_attention(*inputs, window=3, implementation="reference")) < 1e-5


@pytest.mark.parametrize("index, name", [(1, "k_u"), (4, "k_c"), (5, "v_c")])
def test_mismatched_shape_or_dtype_names_the_argument(index, name):
  inputs = list(_inputs(seed=92))
  bad_shape = inputs.copy()
  bad_shape[index] = inputs[index][:, :5]
  with pytest.raises(ValueError, match=name):
    castle_attention(*bad_shape)
  bad_dtype = inputs.copy()
  bad_dtype[index] = inputs[index].astype(jnp.bfloat16)
  with pytest.raises(ValueError, match=f"{name} has dtype"):
    castle_attention(*bad_dtype)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(window=0), "window"),
    (dict(window=-2), "window"),
    (dict(window=2.5), "window"),
    (dict(implementation="flash"), "castle_attention: unknown implementation .flash."),
    (dict(block_size=0), "block_size"),
  ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    castle_attention(*_inputs(seed=93), **kwargs)


def test_bad_rank_and_head_dim():
  inputs = _inputs(seed=94)
  with pytest.raises(ValueError, match=r"q_u must have shape \[batch, seq, heads, head_dim\]"):
    castle_attention(inputs[0][0], *inputs[1:])
  empty_head = _inputs(seed=94, shape=(1, 3, 2, 0))
  with pytest.raises(ValueError, match="head_dim"):
    castle_attention(*empty_head)


def test_cache_overflow_is_an_error():
  inputs = _inputs(seed=95)
  batch, _, heads, head_dim = SHAPE
  cache = init_cache(batch, 4, heads, head_dim, jnp.float32, window=2)
  with pytest.raises(ValueError, match="capacity is 4"):
    prefill(cache, *(x[:, :5] for x in inputs))
  with pytest.raises(ValueError, match="window"):
    init_cache(batch, 4, heads, head_dim, jnp.float32, window=0)
  with pytest.raises(ValueError, match="heads"):
    prefill(cache, *(x[:, :2, :2] for x in inputs))

  _, full = prefill(cache, *(x[:, :4] for x in inputs))
  token = tuple(x[:, 4:5] for x in inputs)
  # Eager: the length is concrete, checked on the host.
  with pytest.raises(ValueError, match="overflow"):
    decode_step(full, *token)
  # Under jit with checkify: a runtime error.
  error, _ = jax.jit(checkify.checkify(decode_step))(full, *token)
  with pytest.raises(checkify.JaxRuntimeError, match="overflow"):
    error.throw()
  # Plain jit: NaN output and the cache left as it was.
  out, after = jax.jit(decode_step)(full, *token)
  assert np.all(np.isnan(np.asarray(out)))
  assert int(after.length) == 4
  for name in ("lookahead_keys", "lookahead_queries", "causal_keys", "causal_values"):
    np.testing.assert_array_equal(getattr(after, name), getattr(full, name))
