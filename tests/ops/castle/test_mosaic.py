"""The CASTLE Mosaic GPU forward on CPU: GPU interpret mode runs the same kernel code
(TMA copies, barriers, wgmma, the warpgroups as threads) and the Mosaic lowering for
an H100 runs on CPU too.

Against the blockwise XLA path in float32 (an independent implementation): outputs,
row log-sum-exps and the final lookahead keys, CASTLE and CASTLE-SWL (windows below
and above the block size, and one long enough past the window for the steps without
W), lengths that are not a multiple of the blocks, head dims 64 and 128. Interpret mode
differs from the GPU in three places (`pallas_kernels.mosaic_common`): register wgmma
operands go through shared memory, accumulators start at zero, and output tiles are added
by read-modify-write instead of a TMA reduce-add; the lowering test covers the GPU variant
of all three.
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle.xla import castle_blockwise_prefill
from helpers import rel_err
from ops.castle.base import forward_inputs, reference_lse
from pallas_kernels.castle.config import CastleMosaicConfig
from pallas_kernels.castle.mosaic import castle_forward_mosaic

# (shape, window); small T keeps interpret mode fast.
CASES = [
  ((1, 200, 2, 64), None),  # ragged; program 0 has steps after its diagonals
  ((1, 300, 1, 64), 100),  # SWL, window > block; later steps without W
  ((1, 128, 1, 128), 5),  # head dim 128, a window inside one block
]


def _mosaic(inputs, window, interpret=True):
  return castle_forward_mosaic(*inputs, scale=inputs[0].shape[-1] ** -0.5, window=window, interpret=interpret)


def _case_inputs(shape, window):
  return forward_inputs(shape[1] + (window or 0), shape)


@pytest.mark.parametrize("number", range(len(CASES)))
def test_interpret_matches_xla(number):
  shape, window = CASES[number]
  inputs = _case_inputs(shape, window)
  result = _mosaic(inputs, window)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_keys = castle_blockwise_prefill(*f32, window=window)
    ref_lse = reference_lse(f32, window)
  assert result.out.dtype == jnp.bfloat16 and result.out.shape == shape
  assert result.lse.shape == (shape[0], shape[2], shape[1]) and result.lookahead_keys.shape == shape
  out = np.asarray(result.out.astype(jnp.float32))
  assert not np.isnan(out).any()
  # bf16 inputs; the lookahead products in float16: errors ~2e-3.
  assert rel_err(out, ref_out) < 1e-2
  assert rel_err(result.lse, ref_lse) < 1e-3
  assert rel_err(result.lookahead_keys, ref_keys) < 1e-2


@pytest.mark.parametrize(
  "head_dim, window",
  [
    (128, None),
    (128, 512),  # both kinds of step: with W and (SWL) without
    (64, 100),
  ],
)
def test_lowers_for_hopper(head_dim, window):
  """The Mosaic GPU lowering (layouts, wgmma shapes, TMA, the reduce-add) for an H100 on CPU."""
  inputs = forward_inputs(0, (1, 256, 2, head_dim))
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100 80GB HBM3", None, "cuda"))
  with jax.sharding.use_abstract_mesh(mesh):
    lowered = jax.jit(lambda *a: _mosaic(a, window, interpret=False)).trace(*inputs).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda x: x.astype(jnp.float32), "bfloat16 or float16"),
    (lambda x: x[..., :32], "head_dim"),
  ],
)
def test_rejects_what_the_kernel_cannot_take(change, message):
  inputs = tuple(change(x) for x in forward_inputs(0, (1, 64, 1, 64)))
  with pytest.raises(ValueError, match=message):
    _mosaic(inputs, None)


def test_config_checks():
  with pytest.raises(ValueError, match="block_q must be 64"):
    CastleMosaicConfig(block_q=128)
  with pytest.raises(ValueError, match=r"CastleMosaicConfig has no key 'schedule'"):
    CastleMosaicConfig.from_string("schedule=simple")
  assert CastleMosaicConfig.from_string("block_k=64") == CastleMosaicConfig()
  assert CastleMosaicConfig().keys_per_program == 128


def test_rejects_mismatched_inputs_and_bad_windows():
  inputs = forward_inputs(0, (1, 64, 1, 64))
  with pytest.raises(ValueError, match=r"k_c must have q_u's shape"):
    _mosaic(inputs[:4] + (inputs[4][:, :32],) + inputs[5:], None)
  with pytest.raises(ValueError, match=r"window must be None or an int >= 1, got 0"):
    _mosaic(inputs, 0)
