"""Decoding with a constant-size state (`castle_jax.ops.power.decode`): the token-by-token recurrence
and prefill then decode against the definition, and memory constant in the length.
"""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.power import (
  append_tokens,
  decode_step,
  expanded_dim,
  init_cache,
  power_attention_recurrent,
  prefill,
)
from helpers import rel_err
from ops.power.base import B, D_HEAD, D_VALUE, HKV, T, power_inputs, reference, split_tokens


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


@pytest.mark.parametrize("p, expansion", [(2, "spow"), (4, "tspow")])
def test_recurrent_matches_definition_float64(p, expansion):
  with jax.enable_x64(True):
    inputs = power_inputs(seed=80 + p, dtype=jnp.float64)
    out, state = jax.jit(power_attention_recurrent, static_argnames=("p", "expansion"))(
      *inputs, p=p, expansion=expansion
    )
    expected, expected_state = reference(*inputs, p=p, expansion=expansion)
    assert rel_err(out, expected) < 1e-12
    assert rel_err(state.state, expected_state.state) < 1e-12
    assert rel_err(state.normalizer, expected_state.normalizer) < 1e-12


@pytest.mark.parametrize("prompt_len, gating", [(5, True), (11, False)])
def test_prefill_then_decode_matches_definition(prompt_len, gating):
  inputs = power_inputs(seed=90 + prompt_len, gating=gating)
  expected, expected_state = reference(*inputs)
  cache = init_cache(B, HKV, D_HEAD, D_VALUE)
  assert cache.state.shape == (B, HKV, expanded_dim(D_HEAD, 2), D_VALUE) and cache.state.dtype == jnp.float32
  out, cache = jax.jit(prefill, static_argnames="chunk_size")(cache, *split_tokens(inputs, 0, prompt_len), chunk_size=2)
  outs = [out]
  step = jax.jit(decode_step)
  for t in range(prompt_len, min(prompt_len + 3, T)):
    out, cache = step(cache, *split_tokens(inputs, t, t + 1))
    outs.append(out)
  done = min(prompt_len + 3, T)
  if done < T:  # then the rest in one piece on the non-empty cache
    out, cache = jax.jit(append_tokens, static_argnames="chunk_size")(
      cache, *split_tokens(inputs, done, T), chunk_size=4
    )
    outs.append(out)
  assert int(cache.length) == T
  assert rel_err(jnp.concatenate(outs, axis=1), expected) < 1e-5
  assert rel_err(cache.state, expected_state.state) < 1e-5
  assert rel_err(cache.normalizer, expected_state.normalizer) < 1e-5


def test_decoding_memory_is_constant_in_length():
  cache = init_cache(B, HKV, D_HEAD, D_VALUE)
  shapes = [
    jax.tree.map(lambda x: x.shape, jax.eval_shape(append_tokens, cache, *power_inputs(seed=95, seq=seq))[1])
    for seq in (1, 64, 1000)
  ]
  assert shapes[0] == shapes[1] == shapes[2] == jax.tree.map(lambda x: x.shape, cache)
