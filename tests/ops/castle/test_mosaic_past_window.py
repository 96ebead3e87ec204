"""CASTLE-SWL's forward split in two Mosaic GPU kernels: the key-major sweep inside the
window and the query-major kernel past it (`pallas_kernels.castle.mosaic_forward_past_window`).

CPU only: GPU interpret mode for the numbers, the H100 lowering for the kernels' shapes
and layouts, and the partition of the (key block, query block) pairs between the two
kernels. The GPU test file (test_gpu_mosaic.py) runs the split at real sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle.xla import castle_blockwise_prefill
from castle_jax.ops.castle.reference import castle_parallel
from helpers import mosaic_kernels_lowered_for_h100, rel_err
from pallas_kernels.castle.mosaic import castle_attention_mosaic
from pallas_kernels.castle.mosaic_forward import key_major_sweep_end
from pallas_kernels.castle.mosaic import castle_forward_mosaic
from pallas_kernels.castle.mosaic_forward_past_window import past_window_key_programs
from ops.castle.base import NAMES, forward_inputs, random_inputs, reference_lse

BLOCK = 64
PROGRAM = 2 * BLOCK
# (seq, head_dim, window): windows of one token, below a block, one block exactly, and
# above a key program; every case has query programs past the window of some keys.
CASES = [(392, 64, 128), (640, 128, 5), (600, 64, 100)]


@pytest.mark.parametrize("window", [1, 5, 63, 64, 65, 100, 127, 128, 129, 256, 300, 512, 1000])
@pytest.mark.parametrize("length", [128, 256, 640, 1024])
def test_the_two_sweeps_cover_every_pair_once(length, window):
  """Every (key block, query block) pair from the key program's first query block on runs
  in exactly one kernel, and the query-major kernel gets only pairs where every key is
  past its lookahead window."""
  num_query_blocks = length // BLOCK
  covered = np.zeros((num_query_blocks, num_query_blocks), int)  # [key block, query block]
  for program in range(length // PROGRAM):
    end = int(
      key_major_sweep_end(
        jnp.int32(program), window=window, block_q=BLOCK, block_k=BLOCK, num_query_blocks=num_query_blocks
      )
    )
    for key_block in (2 * program, 2 * program + 1):
      covered[key_block, 2 * program : end] += 1
  for query_program in range(length // PROGRAM):
    key_programs = int(
      past_window_key_programs(
        jnp.int32(query_program), window=window, keys_per_program=PROGRAM, queries_per_program=PROGRAM
      )
    )
    assert key_programs <= query_program
    if key_programs:
      last_key, first_query = key_programs * PROGRAM - 1, query_program * PROGRAM
      assert first_query > last_key + window  # W = 0 for every pair of these blocks
    covered[: 2 * key_programs, 2 * query_program : 2 * query_program + 2] += 1
  key_blocks, query_blocks = np.indices(covered.shape)
  expected = (query_blocks >= key_blocks // 2 * 2).astype(int)
  np.testing.assert_array_equal(covered, expected)


def _case(number):
  """(inputs, output cotangent, window) of CASES[number]."""
  seq, head_dim, window = CASES[number]
  inputs, cotangent = random_inputs(seq + window, (1, seq, 2, head_dim))
  return inputs, cotangent, window


# The first case runs in the default suite; the other windows run with -m slow and, at real
# sizes, in test_gpu_mosaic.py (interpret mode takes ~50 s a case on 2 cores).
@pytest.mark.parametrize(
  "number", [number if number == 0 else pytest.param(number, marks=pytest.mark.slow) for number in range(len(CASES))]
)
def test_split_matches_the_parallel_form(number):
  """Outputs, lse and lookahead keys, and all six gradients (dQ^C of the past-window pairs
  from the query-major kernel, their key side from a kernel of its own), in GPU interpret
  mode against the blockwise forward and autodiff of `castle_parallel` in float32."""
  inputs, cotangent, window = _case(number)
  scale = inputs[0].shape[-1] ** -0.5
  split = castle_forward_mosaic(*inputs, scale=scale, window=window, interpret=True)
  _, vjp = jax.vjp(lambda *a: castle_attention_mosaic(*a, window=window, interpret=True), *inputs)
  grads = [np.asarray(g.astype(jnp.float32)) for g in vjp(cotangent)]
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_keys = castle_blockwise_prefill(*f32, window=window)
    ref_lse = reference_lse(f32, window)
    _, ref_vjp = jax.vjp(lambda *a: castle_parallel(*a, window=window), *f32)
    ref_grads = ref_vjp(cotangent.astype(jnp.float32))
  # bf16 inputs, float16 lookahead products: ~2e-3, as the key-major forward.
  assert rel_err(split.out.astype(jnp.float32), ref_out) < 1e-2
  assert rel_err(split.lse, ref_lse) < 1e-3
  assert rel_err(split.lookahead_keys, ref_keys) < 1e-2
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    assert np.isfinite(grad).all(), f"d{name}"
    # bf16 gradients, float16 lookahead products: ~3e-3, as the key-major backward.
    assert rel_err(grad, ref) < 1e-2, f"d{name}: {rel_err(grad, ref):.3g}"


def test_split_lowers_for_hopper():
  """Both kernels lower for an H100 (layouts, wgmma shapes and dtypes, TMA, shared memory
  within 227 KB); only CASTLE-SWL runs the second one."""
  inputs = forward_inputs(0, (1, 256, 2, 128))
  forward = lambda window: lambda *a: castle_forward_mosaic(*a, scale=a[0].shape[-1] ** -0.5, window=window).out
  # Each forward runs its kernels twice: the second time in the overflow rerun's branch.
  assert mosaic_kernels_lowered_for_h100((forward(512), forward(None)), inputs) == [4, 2]
  head_dim_64 = forward_inputs(0, (1, 256, 2, 64))
  assert mosaic_kernels_lowered_for_h100((forward(100),), head_dim_64) == [4]
  # The backward adds the key-side kernel and the query-major dQ^C kernel to the key-major one.
  gradients = jax.grad(
    lambda *a: jnp.sum(castle_attention_mosaic(*a, window=512, interpret=False).astype(jnp.float32)),
    argnums=tuple(range(6)),
  )
  assert mosaic_kernels_lowered_for_h100((gradients,), inputs) == [7]
