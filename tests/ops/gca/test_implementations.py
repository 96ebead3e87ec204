"""Every GCA implementation but the oracle passes the same cases through the public op
(`gca_attention(implementation=...)`): output and the four gradients under a random cotangent
against autodiff of the reference (`base.CASES`, bf16). On a CPU the kernels run in Pallas
interpret mode (the Mosaic ones in GPU interpret mode)."""

import functools

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.gca import gca_attention
from ops.gca.base import CASES, assert_matches_the_reference, gca_inputs


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic"])
@pytest.mark.parametrize("case", list(CASES))
def test_output_and_gradients_match_the_reference(implementation, case):
  inputs = gca_inputs(0, **CASES[case], dtype=jnp.bfloat16)
  cotangent = jax.random.normal(jax.random.key(1), inputs[0].shape, jnp.float32)
  attention = functools.partial(gca_attention, implementation=implementation)
  assert_matches_the_reference(attention, inputs, cotangent)
