"""The compiled CASTLE Mosaic GPU forward on a Hopper GPU (skipped without a CUDA GPU).

Against the blockwise XLA path in float32 with full-precision matmuls: outputs, row
log-sum-exps and the final lookahead keys at real head sizes (9 heads x 128 at 2K
tokens, head dim 64, one long sequence), CASTLE and CASTLE-SWL, and ragged lengths. This
is the check of what interpret mode cannot show: register wgmma operands, preinitialized
accumulators, the TMA reduce-add across programs, the swizzled shared-memory layouts, the
register split and the barriers between real warpgroups.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle.xla import castle_blockwise_prefill
from helpers import rel_err
from ops.castle.base import GPU_CASES, forward_inputs
from pallas_kernels.castle.mosaic import castle_forward_mosaic

pytestmark = pytest.mark.gpu


def _reference(inputs, window):
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    return jax.jit(lambda *a: castle_blockwise_prefill(*a, window=window))(*f32)


@pytest.mark.parametrize(
  "shape, window",
  GPU_CASES
  + [
    ((1, 8192, 2, 128), None),  # long sweeps: D sums up to 8K weighted values
  ],
)
def test_mosaic_forward_matches_xla(shape, window):
  inputs = forward_inputs(shape[1] + (window or 0), shape)
  run = jax.jit(lambda *a: castle_forward_mosaic(*a, scale=shape[-1] ** -0.5, window=window))
  assert "mosaic_gpu" in run.lower(*inputs).as_text()
  result = run(*inputs)
  ref_out, ref_keys = _reference(inputs, window)
  out = np.asarray(result.out.astype(jnp.float32))
  assert result.out.dtype == jnp.bfloat16 and np.isfinite(out).all()
  assert rel_err(out, ref_out) < 1e-2
  assert rel_err(result.lookahead_keys, ref_keys) < 1e-2
  assert np.isfinite(np.asarray(result.lse)).all()


def test_mosaic_forward_matches_triton_lse():
  """The row log-sum-exp the backward will read, against the Triton kernels' forward."""
  from pallas_kernels.castle import triton as triton_ops
  from pallas_kernels.castle.config import default_triton_config

  shape = (1, 2048, 4, 128)
  inputs = forward_inputs(3, shape)
  scale = shape[-1] ** -0.5
  result = jax.jit(lambda *a: castle_forward_mosaic(*a, scale=scale))(*inputs)
  heads = tuple(x.transpose(0, 2, 1, 3).reshape(-1, shape[1], shape[-1]) for x in inputs)
  config = default_triton_config(shape[-1])
  _, lse, _ = jax.jit(lambda *a: triton_ops._forward(*a, scale, None, config, False))(*heads)
  assert rel_err(result.lse.reshape(-1, shape[1]), lse) < 1e-3


@pytest.mark.parametrize(
  "shape, window",
  [
    ((2, 4096, 9, 128), 512),
    ((1, 3000, 4, 128), 100),  # ragged, a window between one and two blocks
    ((2, 2048, 4, 64), 64),  # head dim 64, a window of one block
    ((1, 16384, 2, 128), 512),  # long: ~97% of the pairs past the window
  ],
)
def test_past_window_split_matches_xla(shape, window):
  """CASTLE-SWL's pairs past the window in the query-major kernel, against the parallel
  form."""
  inputs = forward_inputs(shape[1] + window, shape)
  split = jax.jit(lambda *a: castle_forward_mosaic(*a, scale=shape[-1] ** -0.5, window=window))(*inputs)
  ref_out, ref_keys = _reference(inputs, window)
  out = np.asarray(split.out.astype(jnp.float32))
  assert np.isfinite(out).all()
  assert rel_err(out, ref_out) < 1e-2
  assert rel_err(split.lookahead_keys, ref_keys) < 1e-2
  assert np.isfinite(np.asarray(split.lse)).all()
