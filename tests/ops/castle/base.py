"""What every CASTLE implementation must pass, and the inputs and checks the CASTLE tests
share: random bf16 inputs, the cases of `test_implementations.py`, and the comparison of an
output and its six gradients with autodiff of the naive parallel form (`castle_parallel`,
float32, full-precision matmuls: the oracle of the chain of trust); and the small float32
and float64 inputs of the math tests with the oracles and the blockwise path jitted."""

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.ops.castle import castle_blockwise, castle_recurrent
from castle_jax.ops.castle.common import combined_scores, lookahead_visible
from castle_jax.ops.castle.reference import castle_parallel
from helpers import rel_err

NAMES = ("q_u", "k_u", "v_u", "q_c", "k_c", "v_c")
# (shape, window, cotangent scale), bf16 inputs with head dims every implementation takes.
CASES = [
  ((1, 100, 2, 64), None, 1.0),  # ragged: 100 tokens in blocks of 64
  ((1, 200, 1, 64), 70, 1.0),  # SWL, the window longer than a block; steps past it
  ((1, 192, 1, 128), 5, 1.0),  # head dim 128, a window inside one block; steps past it
  ((1, 130, 1, 128), None, 1.0),  # head dim 128 without a window: the lookahead path every step
  # A training loss's cotangents (a mean over many tokens): the Mosaic kernels' float16
  # lookahead products would see them as subnormals without rescaling (d{q,k,v}_u 40-80% off).
  ((1, 100, 2, 64), None, 1e-6),
]

# (shape, window) at real sizes for the compiled Mosaic kernels (the GPU tests).
GPU_CASES = [
  ((2, 2048, 9, 128), None),
  ((2, 2048, 9, 128), 512),
  ((1, 1000, 9, 128), None),  # ragged: 1000 tokens in blocks of 64
  ((2, 777, 4, 64), 200),  # ragged, head dim 64, SWL
  ((1, 1, 2, 128), None),  # a single token
]


def random_inputs(seed, shape, dtype=jnp.bfloat16):
  """Six random [batch, seq, heads, head_dim] inputs and an output cotangent, in `dtype`."""
  keys = jax.random.split(jax.random.key(seed), 7)
  inputs = tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys[:6])
  return inputs, jax.random.normal(keys[6], shape, jnp.float32).astype(dtype)


def forward_inputs(seed, shape, dtype=jnp.bfloat16):
  """Six random [batch, seq, heads, head_dim] inputs in `dtype` (the forward tests')."""
  keys = jax.random.split(jax.random.key(seed), 6)
  return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys)


def reference_lse(inputs, window):
  """Row log-sum-exp of the scores A from the naive softmax over visible keys."""
  q_u, k_u, v_u, q_c, k_c, _ = inputs
  seq, head_dim = q_u.shape[1], q_u.shape[-1]
  scale = head_dim**-0.5
  positions = jnp.arange(seq)
  weights = jnp.where(
    lookahead_visible(positions, positions, window),
    jax.nn.sigmoid(jnp.einsum("bshd,bjhd->bhsj", q_u, k_u) * scale),
    0.0,
  )
  # u_s^t for s < t: only keys j <= t count.
  values_scores = jnp.einsum("bthd,bjhd->bhtj", q_c, v_u) * scale
  causal_values = positions[:, None] >= positions[None, :]
  lookahead = jnp.einsum("bhtj,bhsj->bhts", jnp.where(causal_values, values_scores, 0.0), weights)
  scores = combined_scores(jnp.einsum("bthd,bshd->bhts", q_c, k_c) * scale, lookahead)
  scores = jnp.where(causal_values, scores, -jnp.inf)
  return jax.nn.logsumexp(scores, axis=-1)


def jitted_grads(attention, inputs, cotangent):
  """The six input gradients of sum(attention(*inputs) * cotangent), jitted, in float32 sums."""

  def loss(*a):
    return jnp.sum(attention(*a).astype(jnp.float32) * cotangent.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*inputs)


def assert_matches_the_parallel_form(attention, inputs, cotangent, window, tol=1e-2):
  """attention(*inputs)'s output and six gradients under `cotangent` against autodiff of the
  float32 parallel form: same dtypes and shapes as the inputs, finite (no unwritten
  element), relative error below `tol` (bf16 inputs, float16 lookahead products: ~3e-3)."""
  out, vjp = jax.vjp(attention, *inputs)
  grads = vjp(cotangent)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_vjp = jax.vjp(lambda *a: castle_parallel(*a, window=window), *f32)
    ref_grads = ref_vjp(cotangent.astype(jnp.float32))
  assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape
  assert rel_err(out.astype(jnp.float32), ref_out) < tol
  for name, grad, ref, x in zip(NAMES, grads, ref_grads, inputs):
    assert grad.dtype == x.dtype and grad.shape == x.shape, name
    grad = np.asarray(grad.astype(jnp.float32))
    assert np.isfinite(grad).all(), f"d{name} has unwritten or non-finite elements"
    error = rel_err(grad, ref)
    assert error < tol, f"d{name}: relative error {error:.3g}"


# batch, seq, heads, head_dim: seq and heads are not powers of two, and seq is not a
# multiple of the block sizes used below.
SHAPE = (2, 11, 3, 8)


WINDOWS = [None, 1, 3, 30]  # 30 > seq: SWL that never bites.


def math_inputs(seed, shape=SHAPE, dtype=jnp.float32):
  keys = jax.random.split(jax.random.key(seed), 6)
  return tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys)


def recurrent(inputs, window):
  return jax.jit(castle_recurrent, static_argnames="window")(*inputs, window=window)


def parallel(inputs, window):
  return jax.jit(castle_parallel, static_argnames="window")(*inputs, window=window)


def blockwise(inputs, window, block_size):
  fn = jax.jit(castle_blockwise, static_argnames=("window", "block_size"))
  return fn(*inputs, window=window, block_size=block_size)
