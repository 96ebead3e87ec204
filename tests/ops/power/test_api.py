"""The public op `power_attention`: the default implementation (XLA on a CPU, logged), what gating,
the power and the scale do, and bad input named by its argument.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.power import (
  append_tokens,
  decode_step,
  init_cache,
  power_attention,
)
from helpers import rel_err
from ops.power.base import B, D_HEAD, D_VALUE, HKV, attention_form, chunked, bad_cases, power_inputs


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def test_gating_and_power_change_the_outputs_and_scale_cancels():
  inputs = power_inputs(seed=100)
  base = attention_form(*inputs)
  assert rel_err(attention_form(*inputs[:3]), base) > 1e-2  # no gates
  assert rel_err(attention_form(*inputs, p=4), base) > 1e-2
  # The scale multiplies every weight by scale^p, which the normalization divides out:
  # it only moves the numbers' magnitude (overflow, and eps in the log-space form).
  assert rel_err(attention_form(*inputs, scale=1.0), base) < 1e-6
  # The chunked form with one chunk never meets its state path; a misplaced state
  # discount shows when it does.
  q, k, v, log_g = inputs
  shifted = jnp.concatenate([log_g[:, 1:], log_g[:, :1]], axis=1)
  assert rel_err(chunked(q, k, v, shifted, chunk_size=4)[0], base) > 1e-3


def test_default_implementation_is_xla_and_logged(caplog):
  inputs = power_inputs(seed=110)
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    out, state = jax.jit(functools.partial(power_attention, chunk_size=4, return_final_state=True))(*inputs)
  assert "xla" in caplog.text
  expected, expected_state = jax.jit(
    functools.partial(power_attention, implementation="reference", return_final_state=True)
  )(*inputs)
  assert rel_err(out, expected) < 1e-5 and rel_err(state.state, expected_state.state) < 1e-5


@pytest.mark.parametrize("case", range(len(bad_cases()[0])))
def test_bad_input_is_reported(case):
  cases, ok = bad_cases()
  overrides, match = cases[case]
  arrays = {name: overrides.pop(name, ok[name]) for name in ("q", "k", "v", "log_g")}
  with pytest.raises(ValueError, match=match):
    power_attention(arrays["q"], arrays["k"], arrays["v"], arrays["log_g"], **overrides)


def test_bad_cache_input_is_reported():
  inputs = power_inputs(seed=113)
  cache = init_cache(B, HKV, D_HEAD, D_VALUE, p=4)
  with pytest.raises(ValueError, match="initial_state.state has shape"):
    append_tokens(cache, *inputs, p=2)  # a p=4 cache fed as p=2
  with pytest.raises(ValueError, match="decode_step takes one token"):
    decode_step(init_cache(B, HKV, D_HEAD, D_VALUE), *inputs)
