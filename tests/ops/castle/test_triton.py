"""CASTLE Pallas kernels in interpret mode (CPU): the same kernel code the GPU compiles.

Compared with the naive parallel form (Theorem 1): outputs and all six gradients
under random cotangents, CASTLE and CASTLE-SWL, a length that is not a multiple of
any block, unequal query/key blocks, bf16 inputs, length 1, the overflow fallback
of the softmax shift, and bad input. Shapes are tiny: interpret mode compiles each
distinct shape once (seconds) and runs the grid one program at a time.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import castle_attention, castle_parallel, init_cache, prefill
from helpers import lowered_for_h100, rel_err
from pallas_kernels.castle import CastleTritonConfig, castle_attention_triton, common, triton, triton_kernels

SHAPE = (2, 45, 3, 24)  # 45 tokens: a ragged last block; head dim 24 padded to 32
SMALL = CastleTritonConfig(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)
UNEQUAL = CastleTritonConfig(block_q=16, block_k=32, bwd_block_q=32, bwd_block_k=16)


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _inputs(seed, shape=SHAPE, dtype=jnp.float32, scales=(1.0,) * 6):
  keys = jax.random.split(jax.random.key(seed), 7)
  inputs = tuple(s * jax.random.normal(k, shape, jnp.float32) for s, k in zip(scales, keys[:6]))
  return tuple(x.astype(dtype) for x in inputs), jax.random.normal(keys[6], shape, jnp.float32)


def _kernels(*inputs, **kwargs):
  """castle_attention_triton with the op's score scale 1/sqrt(head_dim)."""
  return castle_attention_triton(*inputs, scale=inputs[0].shape[-1] ** -0.5, **kwargs)


def _value_and_grads(fn, inputs, cotangent):
  def loss(*args):
    return jnp.sum(fn(*args).astype(jnp.float32) * cotangent)

  out = jax.jit(fn)(*inputs)
  return out, jax.jit(jax.grad(loss, argnums=range(6)))(*inputs)


def _check_against_parallel(inputs, cotangent, window, config, tol_out, tol_grad):
  out, grads = _value_and_grads(lambda *a: _kernels(*a, window=window, config=config), inputs, cotangent)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  ref, ref_grads = _value_and_grads(lambda *a: castle_parallel(*a, window=window), f32, cotangent)
  assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape
  assert rel_err(out, ref) < tol_out
  for name, g, rg in zip(("q_u", "k_u", "v_u", "q_c", "k_c", "v_c"), grads, ref_grads):
    assert g.dtype == inputs[0].dtype
    assert rel_err(g, rg) < tol_grad, name
  return out


@pytest.mark.parametrize("window, config", [(None, SMALL), (5, SMALL), (20, UNEQUAL)])
def test_outputs_and_gradients_match_parallel_form_float32(window, config):
  inputs, cotangent = _inputs(seed=window or 0)
  out = _check_against_parallel(inputs, cotangent, window, config, 1e-5, 1e-5)
  # The window matters for these inputs, so the comparison above can fail.
  if window is not None:
    assert rel_err(out, castle_parallel(*inputs)) > 1e-3


def test_bf16_inputs_against_the_float32_parallel_form():
  """bf16 inputs against the float32 parallel form: the lookahead branch's float32
  intermediates enter float16 products, which keep the gradients within 5e-3 here
  (bfloat16 operands would give about three times that)."""
  inputs, cotangent = _inputs(seed=3, shape=(1, 120, 2, 64), dtype=jnp.bfloat16)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  ref, ref_grads = _value_and_grads(lambda *a: castle_parallel(*a), f32, cotangent)
  out, grads = _value_and_grads(lambda *a: _kernels(*a, config=SMALL), inputs, cotangent)
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref) < 1e-2
  worst = max(rel_err(g, rg) for g, rg in zip(grads, ref_grads))
  assert worst < 5e-3, worst


def test_length_one_and_single_block():
  """One token: the output is its own causal value, and only v_c has a gradient (the
  cotangent); the others vanish in exact arithmetic (a softmax over one key, no later
  token for a lookahead key), so they are bounded by float32 rounding, not compared by a
  relative error against an exact zero."""
  inputs, cotangent = _inputs(seed=4, shape=(1, 1, 2, 16))
  out, grads = _value_and_grads(lambda *a: _kernels(*a, config=SMALL), inputs, cotangent)
  assert out.shape == inputs[0].shape
  assert rel_err(out, inputs[5]) < 1e-6
  assert rel_err(grads[5], cotangent) < 1e-6
  ref_grads = _value_and_grads(castle_parallel, inputs, cotangent)[1]
  for name, g, rg in zip(("q_u", "k_u", "v_u", "q_c", "k_c"), grads, ref_grads):
    assert float(jnp.max(jnp.abs(rg))) == 0.0, name  # the reference's exact zero
    assert float(jnp.max(jnp.abs(g))) < 1e-5, name


def test_score_overflow_falls_back_to_the_row_maximum():
  """Scores far above a row's diagonal score overflow exp under the default shift."""
  inputs, cotangent = _inputs(seed=5, scales=(1.0, 1.0, 1.0, 12.0, 12.0, 1.0))
  causal_scores = jnp.einsum("bthd,bshd->bhts", inputs[3], inputs[4]) / np.sqrt(SHAPE[-1])
  visible = np.tril(np.ones(SHAPE[1:2] * 2, bool))
  above_diagonal = jnp.max(jnp.where(visible, causal_scores, -jnp.inf), -1) - jnp.diagonal(causal_scores, 0, 2, 3)
  assert float(jnp.max(above_diagonal)) > 100
  # The diagonal shift alone overflows for these inputs, so the fallback is exercised.
  heads, _ = triton._prepare(inputs, SMALL)
  scale = 1 / np.sqrt(SHAPE[-1])
  _, sums, _ = triton_kernels.forward(
    *heads,
    shift=common._diagonal_scores(heads[3], heads[4], scale),
    in_block=common.in_block_scores(heads[3], heads[2], scale, SMALL.block_q),
    scale=scale,
    window=None,
    config=SMALL,
    interpret=True,
  )
  assert not np.all(np.isfinite(np.asarray(sums)))
  out = _check_against_parallel(inputs, cotangent, None, SMALL, 1e-5, 1e-4)
  assert np.all(np.isfinite(np.asarray(out)))


def test_entry_point_dispatches_to_the_kernels():
  inputs, _ = _inputs(seed=6, shape=(1, 20, 1, 16))
  out = castle_attention(*inputs, implementation="triton", kernel_config=SMALL)
  assert rel_err(out, castle_parallel(*inputs)) < 1e-5


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(block_q=24), "block_q must be a power of two"),
    (dict(block_k=8), "block_k must be >= 16"),
    (dict(num_warps=0), "num_warps must be an int >= 1"),
  ],
)
def test_bad_kernel_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    CastleTritonConfig(**kwargs)


def test_bad_inputs_name_the_argument():
  inputs, _ = _inputs(seed=7, shape=(1, 8, 1, 16))
  with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
    with jax.enable_x64(True):
      _kernels(*(np.asarray(x, np.float64) for x in inputs))
  # Shapes and the window are checked by the op's entry point, before the kernels run.
  with pytest.raises(ValueError, match="k_c has shape"):
    castle_attention(*inputs[:4], inputs[4][:, :4], inputs[5], implementation="triton")
  with pytest.raises(ValueError, match="window"):
    castle_attention(*inputs, window=0, implementation="triton")


@pytest.mark.parametrize("window", [None, 3])
def test_prefill_with_the_kernel_fills_the_same_cache(window):
  """The kernel's final D is U^L: prefill through it equals the blockwise prefill."""
  inputs, _ = _inputs(seed=8, shape=(1, 20, 2, 16))
  cache = init_cache(1, 24, 2, 16, jnp.float32, window)
  out, filled = prefill(cache, *inputs, implementation="triton")
  ref_out, ref_filled = prefill(cache, *inputs, implementation="xla", block_size=8)
  assert rel_err(out, ref_out) < 1e-5
  for name in ("lookahead_keys", "lookahead_queries", "causal_keys", "causal_values"):
    assert rel_err(getattr(filled, name), getattr(ref_filled, name)) < 1e-5, name
  assert int(filled.length) == 20
  # The lookahead keys are not trivially zero, so the comparison can fail.
  assert float(jnp.abs(filled.lookahead_keys).max()) > 0.1


@pytest.mark.parametrize("window", [None, 48])
def test_forward_and_backward_lower_for_an_h100(window):
  # Interpret mode never builds Triton IR, so what the Triton lowering rejects shows only here or
  # on a GPU. Default tiles, bf16, 300 tokens (a ragged last block) of 2 heads of 64.
  inputs = tuple(jax.ShapeDtypeStruct((1, 300, 2, 64), jnp.bfloat16) for _ in range(6))

  def loss(*args):
    return jnp.sum(castle_attention_triton(*args, scale=0.125, window=window, interpret=False).astype(jnp.float32))

  text = lowered_for_h100(jax.grad(loss, argnums=range(6)), inputs)
  assert "castle_forward" in text and "castle_backward" in text
