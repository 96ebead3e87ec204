"""The oracles (`castle_jax.ops.power.reference`): the paper's log-space form and a continued state
against the definition in float64, and outputs that are the weighted mean computed by hand.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import rel_err
from ops.power.base import (
  HKV,
  HQ,
  T,
  assert_gradients_match_definition,
  attention_form,
  final_state_of,
  log_space,
  power_inputs,
  split_tokens,
  tiny_weight_inputs,
)


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


@pytest.mark.parametrize("p, gating", [(2, True), (4, True), (2, False)])
def test_log_space_form_matches_definition_float64(p, gating):
  with jax.enable_x64(True):
    inputs = power_inputs(seed=10 + p, dtype=jnp.float64, gating=gating)
    expected = attention_form(*inputs, p=p)
    assert rel_err(log_space(*inputs, p=p, eps=0.0), expected) < 1e-12
    # The paper's eps = 1e-7 moves the weights by a relative p * eps / |s|.
    assert rel_err(log_space(*inputs, p=p), expected) < 1e-5


def test_reference_continues_from_a_state_float64():
  """The attention form with an initial state equals the same rows of the longer sequence."""
  with jax.enable_x64(True):
    inputs = power_inputs(seed=11, dtype=jnp.float64)
    full = attention_form(*inputs, p=2)
    state = final_state_of(*split_tokens(inputs, 0, 4)[1:], p=2)
    rest = attention_form(*split_tokens(inputs, 4, T), p=2, initial_state=state)
    assert rel_err(rest, full[:, 4:]) < 1e-12
    both = final_state_of(*split_tokens(inputs, 4, T)[1:], p=2, initial_state=state)
    whole = final_state_of(*inputs[1:], p=2)
    assert rel_err(both.state, whole.state) < 1e-12 and rel_err(both.normalizer, whole.normalizer) < 1e-12


def test_outputs_are_the_weighted_mean_computed_by_hand():
  with jax.enable_x64(True):
    q, k, v, log_g = (np.asarray(x, np.float64) for x in power_inputs(seed=12, seq=5, dtype=jnp.float64))
    out = np.asarray(attention_form(q, k, v, log_g, p=4, scale=0.3))
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


def test_gradients_where_the_weights_are_tiny():
  """p = 4, float32, rows whose weights sum to ~1e-24 (a first query nearly orthogonal to
  the first key, and a query of norm 1e-6). The outputs were fine, but autodiff of the
  division formed N / D^2 = N / 0 and the gradients were inf/NaN (training with p = 4
  stopped on a NaN gradient norm after 11 steps); they equal the definition's in float64."""
  assert_gradients_match_definition(lambda *a: attention_form(*a, p=4), tiny_weight_inputs(seed=13), 4, 1e-5)
