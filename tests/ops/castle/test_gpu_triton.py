"""Compiled CASTLE Pallas kernels on the GPU at real head sizes (skipped without a CUDA GPU).

Against the naive parallel form in float32 with full-precision matmuls: outputs and
all six gradients, for head dims 64/96/128 (Table 3 uses all three), a length that is
not a multiple of the blocks, SWL windows from 64 to 1024, float32 and bf16 inputs.
"""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.castle import castle_attention, castle_parallel
from helpers import rel_err

pytestmark = pytest.mark.gpu


def _inputs(seed, shape, dtype):
  keys = jax.random.split(jax.random.key(seed), 7)
  inputs = tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys[:6])
  return inputs, jax.random.normal(keys[6], shape, jnp.float32)


def _grads(impl, window, inputs, cotangent):
  def loss(*args):
    out = castle_attention(*args, window=window, implementation=impl)
    return jnp.sum(out.astype(jnp.float32) * cotangent)

  return jax.jit(jax.grad(loss, argnums=range(6)))(*inputs)


@pytest.mark.parametrize(
  "head_dim, window, dtype, seq",
  [
    (128, None, jnp.bfloat16, 1000),
    (96, 64, jnp.bfloat16, 1000),
    (64, 1024, jnp.bfloat16, 1000),
    (128, None, jnp.float32, 700),
    (64, 200, jnp.float32, 700),
    (128, None, jnp.bfloat16, 1),
    (128, None, jnp.bfloat16, 4096),
  ],
)
def test_triton_matches_parallel_form(head_dim, window, dtype, seq):
  shape = (2, seq, 3, head_dim)
  inputs, cotangent = _inputs(head_dim + (window or 0), shape, dtype)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(lambda *a: castle_parallel(*a, window=window))(*f32)
    ref_grads = _grads("reference", window, f32, cotangent)
  out = jax.jit(lambda *a: castle_attention(*a, window=window, implementation="triton"))(*inputs)
  grads = _grads("triton", window, inputs, cotangent)
  tol_out, tol_grad = (1e-2, 1e-2) if dtype == jnp.bfloat16 else (1e-4, 1e-4)
  assert out.dtype == dtype
  assert rel_err(out.astype(jnp.float32), ref) < tol_out
  # Gradients that vanish exactly (every input but v_c at length 1) are compared
  # relative to the largest gradient instead of their own zero norm.
  floor = 1e-3 * max(float(jnp.linalg.norm(rg)) for rg in ref_grads)
  for name, g, rg in zip(("q_u", "k_u", "v_u", "q_c", "k_c", "v_c"), grads, ref_grads):
    error = float(jnp.linalg.norm(g.astype(jnp.float32) - rg)) / max(float(jnp.linalg.norm(rg)), floor)
    assert error < tol_grad, name


def test_default_on_gpu_is_a_kernel():
  inputs, _ = _inputs(0, (1, 128, 2, 64), jnp.bfloat16)
  text = jax.jit(lambda *a: castle_attention(*a)).lower(*inputs).as_text()
  assert "castle_forward" in text


@pytest.mark.parametrize(
  "head_dim, window, dtype",
  [(128, None, jnp.bfloat16), (64, None, jnp.float32), (128, 200, jnp.bfloat16), (64, 1024, jnp.float32)],
)
def test_triton_decoding_matches_xla_step(head_dim, window, dtype):
  """The fused decoding kernel against the XLA step: outputs and the whole cache after
  a prompt of 2500 tokens and 6 steps, capacity 3000 (a ragged last block)."""
  from castle_jax.ops.castle import decode_step, init_cache, prefill

  batch, heads, prompt, steps = 4, 3, 2500, 6
  inputs, _ = _inputs(7 + head_dim, (batch, prompt + steps, heads, head_dim), dtype)
  cache = init_cache(batch, 3000, heads, head_dim, dtype, window=window)
  _, cache = jax.jit(prefill)(cache, *(x[:, :prompt] for x in inputs))
  tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
  caches = {}
  with jax.default_matmul_precision("highest"):
    for impl in ("xla", "triton"):
      step = jax.jit(lambda c, *a, impl=impl: decode_step(c, *a, implementation=impl))
      if impl == "triton":
        assert "castle_decode" in step.lower(cache, *(x[:, :1] for x in inputs)).as_text()
      state, outs = cache, []
      for t in range(prompt, prompt + steps):
        out, state = step(state, *(x[:, t : t + 1] for x in inputs))
        outs.append(out.astype(jnp.float32))
      caches[impl] = (jnp.concatenate(outs, axis=1), state)
  (out_xla, cache_xla), (out_triton, cache_triton) = caches["xla"], caches["triton"]
  assert int(cache_triton.length) == prompt + steps
  assert rel_err(out_triton, out_xla) < tol
  for name in ("lookahead_keys", "lookahead_queries", "causal_keys", "causal_values"):
    assert (
      rel_err(getattr(cache_triton, name).astype(jnp.float32), getattr(cache_xla, name).astype(jnp.float32)) < tol
    ), name
