"""Every tree-attention implementation but the oracle passes the same cases through the public
op (`tree_attention(implementation=..., return_lse=True)`): outputs and log-sum-exps against
the dense reference, with grouped heads, an empty cache row, a chain tree and one node. On a
CPU the kernels run in Pallas interpret mode. The Mosaic kernel takes 16-bit inputs at head
dim 64 or 128: it passes the same cases there."""

import functools

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.tree_attention import tree_attention
from helpers import assert_close
from ops.tree_attention.base import TOLERANCE, make_inputs, reference

# Head dims the kernel takes (powers of two >= 16).
CASES = [
  dict(head_dim=16),
  dict(head_dim=16, cache_length=[0, 11], tree="chain"),
  dict(head_dim=32, heads=6, kv_heads=3, n=1),
]


@pytest.mark.usefixtures("full_float32_matmuls")
@pytest.mark.parametrize("implementation", ["xla", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_outputs_and_lse_match_the_reference(implementation, dtype, case):
  inputs = make_inputs(20 + case, **CASES[case], dtype=dtype)
  attention = jax.jit(functools.partial(tree_attention, implementation=implementation, return_lse=True))
  out, lse = attention(**inputs)
  upcast = {name: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for name, x in inputs.items()}
  expected_out, expected_lse = reference(**upcast)
  assert out.dtype == dtype
  assert_close(out.astype(jnp.float32), expected_out, TOLERANCE[dtype])
  assert_close(lse, expected_lse, TOLERANCE[dtype])


@pytest.mark.usefixtures("full_float32_matmuls")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_mosaic_outputs_and_lse_match_the_reference(case):
  inputs = make_inputs(20 + case, **{**CASES[case], "head_dim": 64}, dtype=jnp.bfloat16)
  attention = jax.jit(functools.partial(tree_attention, implementation="mosaic", return_lse=True))
  out, lse = attention(**inputs)
  upcast = {name: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for name, x in inputs.items()}
  expected_out, expected_lse = reference(**upcast)
  assert out.dtype == jnp.bfloat16
  assert_close(out.astype(jnp.float32), expected_out, TOLERANCE[jnp.bfloat16])
  assert_close(lse, expected_lse, TOLERANCE[jnp.bfloat16])
