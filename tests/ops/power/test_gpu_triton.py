"""Compiled power-attention Pallas kernels on the GPU at real sizes (skipped without a CUDA GPU).

Against the XLA chunked form in float32 with full-precision matmuls (itself checked
against the definition on CPU): outputs, final states and the gradients of q, k, v and
the log-gates, for head dims 32/64/128, grouped-query heads, a length that is not a
multiple of the chunk, several chunk sizes, float32 and bf16 inputs, the attention form
alone (one chunk, no state), and one token after an initial state (without one, a single
token's output is v whatever q, k and the gate, so their gradients vanish and only
rounding is left to compare).
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.power import PowerState, expand, power_attention
from helpers import rel_err
from pallas_kernels.power import PowerTritonConfig

pytestmark = pytest.mark.gpu

# The Triton kernels wherever "auto" would pick the Mosaic GPU ones (test_mosaic_kernels_... runs those).
TRITON_ONLY = PowerTritonConfig(
  in_chunk_attention="triton", update_state="triton", query_state="triton", state_gradient="triton"
)


def _inputs(seed, batch, seq, heads, kv_heads, head_dim, dtype):
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (batch, seq, heads, head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim), jnp.float32)
  log_g = jax.nn.log_sigmoid(3.0 + jax.random.normal(keys[3], (batch, seq, kv_heads), jnp.float32))
  cotangent = jax.random.normal(keys[4], (batch, seq, heads, head_dim), jnp.float32)
  return (q.astype(dtype), k.astype(dtype), v.astype(dtype), log_g), cotangent


def _initial_state(seed, batch, kv_heads, head_dim):
  """A state 8 earlier tokens could have left (so its normalizer is positive)."""
  keys = jax.random.split(jax.random.key(seed), 2)
  k = jax.random.normal(keys[0], (batch, kv_heads, 8, head_dim), jnp.float32) * head_dim**-0.25
  v = jax.random.normal(keys[1], (batch, kv_heads, 8, head_dim), jnp.float32)
  phi = expand(k, 2, "tspow", 16)
  return PowerState(jnp.einsum("bhtD,bhte->bhDe", phi, v), jnp.sum(phi, axis=2))


def _run(impl, chunk, inputs, cotangent, initial_state, kernel_config=None):
  attention = functools.partial(
    power_attention,
    chunk_size=chunk,
    implementation=impl,
    expansion="tspow",
    d_tile=16,
    initial_state=initial_state,
    kernel_config=kernel_config,
  )
  _, state = jax.jit(functools.partial(attention, return_final_state=True))(*inputs)
  # Without the state a sequence within one chunk runs the attention form alone.
  out = jax.jit(attention)(*inputs)

  def loss(*args):
    return jnp.sum(attention(*args).astype(jnp.float32) * cotangent)

  grads = jax.jit(jax.grad(loss, argnums=range(4)))(*inputs)
  return out, state, grads


# Few cases: each compiles every kernel anew (tens of seconds on the GPU machine).
@pytest.mark.parametrize(
  "head_dim, seq, chunk, heads, kv_heads, dtype",
  [
    (64, 1000, 256, 4, 4, jnp.float32),
    (64, 2048, 1024, 6, 2, jnp.bfloat16),
    (32, 700, 128, 2, 2, jnp.bfloat16),
    (64, 1, 64, 2, 2, jnp.bfloat16),
    (128, 512, 256, 2, 1, jnp.bfloat16),
    (64, 1000, 1024, 4, 2, jnp.bfloat16),
  ],
)
def test_compiled_kernels_match_the_chunked_form(head_dim, seq, chunk, heads, kv_heads, dtype):
  inputs, cotangent = _inputs(head_dim + seq, 2, seq, heads, kv_heads, head_dim, dtype)
  initial_state = _initial_state(seq, 2, kv_heads, head_dim) if seq == 1 else None
  with jax.default_matmul_precision("highest"):
    expected = _run("xla", chunk, tuple(x.astype(jnp.float32) for x in inputs), cotangent, initial_state)
    ours = _run("triton", chunk, inputs, cotangent, initial_state, TRITON_ONLY)
  # One token: its k gradient is 2 s q (dN . v + d_den), a difference of near-equal terms
  # (the output is close to v), so bf16 rounding of dN shows more (~2.5e-2 in interpret mode).
  tolerance = 1e-4 if dtype == jnp.float32 else 5e-2 if seq == 1 else 2e-2
  (out, state, grads), (expected_out, expected_state, expected_grads) = ours, expected
  assert rel_err(out, expected_out) < tolerance
  assert rel_err(state.state, expected_state.state) < tolerance
  assert rel_err(state.normalizer, expected_state.normalizer) < tolerance
  for name, g, e in zip(("q", "k", "v", "log_g"), grads, expected_grads):
    assert rel_err(g, e) < tolerance, name


@pytest.mark.parametrize("head_dim, seq, chunk, heads, kv_heads", [(64, 2048, 1024, 6, 2), (128, 1000, 256, 2, 1)])
def test_mosaic_kernels_match_the_chunked_form(head_dim, seq, chunk, heads, kv_heads):
  """Every part that can on the Mosaic GPU kernels (bf16, Hopper): outputs, final state, gradients."""
  inputs, cotangent = _inputs(head_dim + seq + 1, 2, seq, heads, kv_heads, head_dim, jnp.bfloat16)
  with jax.default_matmul_precision("highest"):
    expected = _run("xla", chunk, tuple(x.astype(jnp.float32) for x in inputs), cotangent, None)
  ours = _run(
    "triton",
    chunk,
    inputs,
    cotangent,
    None,
    PowerTritonConfig(
      in_chunk_attention="mosaic", update_state="mosaic", query_state="mosaic", state_gradient="mosaic"
    ),
  )
  (out, state, grads), (expected_out, expected_state, expected_grads) = ours, expected
  assert rel_err(out, expected_out) < 2e-2
  assert rel_err(state.state, expected_state.state) < 2e-2
  for name, g, e in zip(("q", "k", "v", "log_g"), grads, expected_grads):
    assert rel_err(g, e) < 2e-2, name
