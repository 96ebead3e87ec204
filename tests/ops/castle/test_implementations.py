"""Every CASTLE implementation but the oracle passes the same cases through the public op
(`castle_attention(implementation=...)`): output and all six gradients under a random
cotangent against autodiff of the parallel form (`base.CASES`). On a CPU the kernels run in
Pallas interpret mode (the Mosaic ones in GPU interpret mode)."""

import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import castle_attention
from ops.castle.base import CASES, assert_matches_the_parallel_form, random_inputs


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic"])
@pytest.mark.parametrize("shape, window, cotangent_scale", CASES)
def test_output_and_gradients_match_the_parallel_form(implementation, shape, window, cotangent_scale):
  inputs, cotangent = random_inputs(shape[1] + (window or 0), shape)
  cotangent = (cotangent.astype(jnp.float32) * cotangent_scale).astype(cotangent.dtype)
  attention = lambda *a: castle_attention(*a, window=window, implementation=implementation)
  assert_matches_the_parallel_form(attention, inputs, cotangent, window)


def _one_score_far_above_the_diagonal(gap: float, value: float):
  """bf16 inputs [1, 128, 1, 64] where query 100's causal score on key 10 is ~`gap` above its
  diagonal score and key 10's value is `value` in every dimension; a random cotangent."""
  inputs, cotangent = random_inputs(0, (1, 128, 1, 64))
  q_u, k_u, v_u, q_c, k_c, v_c = (np.array(x.astype(jnp.float32)) for x in inputs)
  query, key = 100, 10
  k_c[..., 0] = 0.0  # the first dimension carries only the one large score
  q_c[0, query, 0, 0] = 16.0
  diagonal = q_c[0, query, 0] @ k_c[0, query, 0]
  # q . k of the other dimensions is kept, and the first one makes up the rest of the gap.
  k_c[0, key, 0, 0] = (gap * 8.0 + diagonal - q_c[0, query, 0] @ k_c[0, key, 0]) / 16.0
  v_c[0, key, 0, :] = value
  return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q_u, k_u, v_u, q_c, k_c, v_c)), cotangent


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic"])
def test_a_weighted_value_that_overflows_under_the_diagonal_shift(implementation):
  """A score 87 above its row's diagonal score: exp of it fits float32 (so the row's sum does)
  but times a value of 10 it does not, and the kernels' first shift leaves an infinite output
  unless they rerun on the output's overflow too."""
  inputs, cotangent = _one_score_far_above_the_diagonal(gap=87.0, value=10.0)
  q_c, k_c = (np.asarray(x.astype(jnp.float32))[0, :, 0] for x in inputs[3:5])
  gap = (q_c[100] @ k_c[10] - q_c[100] @ k_c[100]) / 8.0
  largest = np.finfo(np.float32).max
  assert np.exp(np.float64(gap)) < largest < np.exp(np.float64(gap)) * 10.0, gap
  attention = lambda *a: castle_attention(*a, window=32, implementation=implementation)
  # Scores of ~87 in bf16 lose a little more of dK^C than random inputs do (1.0e-2 measured).
  assert_matches_the_parallel_form(attention, inputs, cotangent, 32, tol=2e-2)
