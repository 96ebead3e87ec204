"""Every CASTLE implementation but the oracle passes the same cases through the public op
(`castle_attention(implementation=...)`): output and all six gradients under a random
cotangent against autodiff of the parallel form (`base.CASES`). On a CPU the kernels run in
Pallas interpret mode (the Mosaic ones in GPU interpret mode)."""

import jax.numpy as jnp
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
