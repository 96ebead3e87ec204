"""The CASTLE Mosaic GPU backward on CPU: GPU interpret mode runs the same kernel code
(both warpgroups as concurrent threads, their barriers, TMA copies, wgmma), and the
Mosaic lowering of forward and backward for an H100 runs on CPU too.

The gradients against autodiff of the parallel form run in `test_implementations.py` (the
cases every implementation passes: CASTLE and CASTLE-SWL with windows above and below the
block size, a length that is not a multiple of the blocks, head dims 64 and 128, a training
loss's small cotangents). Interpret mode differs from the GPU where the forward does (module
docstring of `mosaic_backward`); the lowering tests here cover the GPU variant, and the
kernels' bad inputs.
"""

import jax
import jax.numpy as jnp
import pytest

from helpers import mosaic_kernels_lowered_for_h100
from ops.castle.base import random_inputs
from pallas_kernels.castle.mosaic import castle_attention_mosaic


def test_backward_lowers_for_hopper():
  """The Mosaic GPU lowering of the backward kernel (layouts, wgmma shapes and dtypes,
  TMA reduce-adds, the two warpgroups, shared memory within 227 KB) for an H100 on CPU."""
  inputs, _ = random_inputs(0, (1, 128, 2, 128))
  for window in (None, 512):
    loss = lambda *a: jnp.sum(castle_attention_mosaic(*a, window=window, interpret=False).astype(jnp.float32))
    kernels = mosaic_kernels_lowered_for_h100((loss, jax.grad(loss, argnums=tuple(range(6)))), inputs)
    # The forward's kernels and the backward's: under a window also the past-window key-side and dQ^C kernels.
    assert kernels[0] >= 1 and kernels[1] == kernels[0] + (1 if window is None else 3)


def test_rematerialized_forward_still_runs_its_kernel():
  """Under jax.checkpoint the backward pass recomputes the forward: its kernel calls must be
  there again. (Kernels writing `jax.new_ref` outputs were dropped from the recomputation,
  which then read zeros: NaN outputs and gradients in a rematerialized model.)"""
  inputs, _ = random_inputs(0, (1, 128, 2, 64))
  loss = lambda *a: jnp.sum(jnp.tanh(castle_attention_mosaic(*a, interpret=False).astype(jnp.float32)))
  kernels = mosaic_kernels_lowered_for_h100(
    (
      loss,
      jax.value_and_grad(loss, argnums=tuple(range(6))),
      jax.value_and_grad(jax.checkpoint(loss), argnums=tuple(range(6))),
    ),
    inputs,
  )
  # The value's forward, then the recomputed one, then the backward.
  forward, plain, rematerialized = kernels
  assert rematerialized == plain + forward, kernels


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda x: x.astype(jnp.float32), "bfloat16 or float16"),
    (lambda x: x[..., :32], "head_dim"),
    (lambda x: x[0], r"q_u must be \[batch, seq, heads, head_dim\]"),
  ],
)
def test_rejects_what_the_kernels_cannot_take(change, message):
  inputs, _ = random_inputs(0, (1, 64, 1, 64))
  with pytest.raises(ValueError, match=message):
    jax.grad(lambda *a: jnp.sum(castle_attention_mosaic(*a)))(*(change(x) for x in inputs))


def test_rejects_bad_windows():
  inputs, _ = random_inputs(0, (1, 64, 1, 64))
  with pytest.raises(ValueError, match=r"window must be None or an int >= 1, got 0"):
    castle_attention_mosaic(*inputs, window=0)
