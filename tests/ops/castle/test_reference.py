"""The oracles (`castle_jax.ops.castle.reference`): the recurrent definition (Eqs. 2-7) checks the
parallel form (Theorem 1) in float64, the lookahead keys match a sum by hand, and the lookahead
score takes the causal query.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import lookahead_keys
from castle_jax.ops.castle.reference import lookahead_scores_parallel
from helpers import rel_err
from ops.castle.base import SHAPE, WINDOWS, math_inputs, parallel, recurrent


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


@pytest.mark.parametrize("window", WINDOWS)
def test_parallel_form_matches_recurrent_definition_float64(window):
  with jax.enable_x64(True):
    inputs = math_inputs(seed=1 + (window or 0), dtype=jnp.float64)
    out = parallel(inputs, window)
    expected = recurrent(inputs, window)
    assert out.dtype == jnp.float64
    assert rel_err(out, expected) < 1e-12


def test_lookahead_keys_match_brute_force_sum():
  """Eq. (2) against u_s^t = sum_{s<j<=min(t, s+W)} sigmoid(q_s.k_j/sqrt(d)) v_j, by hand."""
  q_u, k_u, v_u = (np.asarray(x, np.float64) for x in math_inputs(seed=2, shape=(1, 6, 1, 4))[:3])
  t, window = 5, 2
  keys = np.asarray(lookahead_keys(q_u, k_u, v_u, t, window=window))[0, :, 0]
  expected = np.zeros((t, 4))
  for s in range(t):
    for j in range(s + 1, min(t - 1, s + window) + 1):
      expected[s] += v_u[0, j, 0] / (1.0 + np.exp(-q_u[0, s, 0] @ k_u[0, j, 0] / 2.0))
  assert np.all(keys[-1] == 0)
  assert rel_err(keys, expected) < 1e-6


def test_lookahead_score_uses_the_causal_query():
  """Scoring lookahead keys with q^U (Eq. 5 / Alg. 4 line 10 as printed) gives other outputs."""
  with jax.enable_x64(True):
    inputs = math_inputs(seed=80, dtype=jnp.float64)
    q_u, k_u, v_u, q_c, k_c, v_c = inputs
    correct = recurrent(inputs, None)
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
    assert rel_err(recurrent(inputs, 2), correct) > 1e-3
