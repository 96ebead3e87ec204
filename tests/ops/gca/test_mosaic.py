"""The GCA Mosaic GPU forward on CPU: GPU interpret mode runs the same kernel code (TMA
copies, barriers, wgmma), and the Mosaic lowering for an H100 runs on CPU too.

Outputs against the XLA path in float32 (an independent implementation) and against the
Triton forward in interpret mode; the per-slot log-normalizers against a direct float32
log-sum-exp over each slot's scores with the implicit zero logit, and against the Triton
forward's (the same layout and base-2 units, which its backward consumes). Retrievals
include one chunk twice in a query chunk's slots, a chunk every query chunk reads, an
empty slot (weight 0) and an out-of-range index (clipped); shapes include grouped heads, a
query chunk of two 64-row tiles (65 rows, zero-padded), head dim 128, a ring shallower
than k (buffers refilled) and float16; a deeper ring against the default one.
Interpret mode differs from the GPU in two places (module docstring of `mosaic_forward`);
the lowering test covers the GPU variant, and measures the shared memory the lowering
allocates at the drt_128m shape.
"""

import math

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.gca import gca_attention
from helpers import rel_err
from ops.gca.base import DRT_128M, H100_SHARED_MEMORY, MOSAIC_CASES, drt_padded_structs, gca_inputs, lower_for_hopper
from pallas_kernels.gca import triton_kernels, mosaic_forward
from pallas_kernels.gca.config import default_triton_config
from pallas_kernels.gca.triton import tiling_for

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _reference_lse(q, chunk_k, weights, indices, scale):
  """float32 [batch, query_chunks, k, query_len, heads]: log2(1 + sum_s exp(q k_s * scale)) / log2 units,
  i.e. the slot's softmax_1 log-normalizer in base-2 score units."""
  batch, seq, heads, head_dim = q.shape
  query_chunks, top_k = indices.shape[1:]
  memory_chunks, kv_heads = chunk_k.shape[1], chunk_k.shape[3]
  queries = q.astype(jnp.float32).reshape(
    batch, query_chunks, seq // query_chunks, kv_heads, heads // kv_heads, head_dim
  )
  retrieved = jax.vmap(lambda k, i: k[i])(chunk_k.astype(jnp.float32), jnp.clip(indices, 0, memory_chunks - 1))
  scores = jnp.einsum("bcqhgd,bcjshd->bcjqhgs", queries, retrieved) * scale
  with_zero_logit = jnp.concatenate([jnp.zeros(scores.shape[:-1] + (1,)), scores], axis=-1)
  lse = jax.nn.logsumexp(with_zero_logit, axis=-1) / math.log(2.0)
  return lse.reshape(*lse.shape[:4], heads)


@pytest.mark.parametrize("case", list(MOSAIC_CASES))
def test_interpret_matches_xla_and_triton(case):
  shape, stages = MOSAIC_CASES[case]
  inputs = gca_inputs(0, **shape)
  q, chunk_k, chunk_v, weights, indices = inputs
  scale = shape["head_dim"] ** -0.5
  out, lse = mosaic_forward.gca_forward_mosaic(*inputs, scale=scale, stages=stages, interpret=True)
  out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
  query_len = shape["query_len"]
  assert out.shape == q.shape and lse.shape[:3] == indices.shape and lse.shape[4] == shape["heads"]
  assert lse.shape[3] == -(-query_len // 64) * 64
  assert not np.isnan(out).any() and not np.isnan(lse).any()

  inputs32 = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs)
  reference = jax.jit(lambda *a: gca_attention(*a, implementation="xla"))(*inputs32)
  # bf16/f16 operands, P rounded to them after folding in w_j / l_j: errors ~2e-3.
  assert rel_err(out, reference) < 1e-2, rel_err(out, reference)
  reference_lse = _reference_lse(q, chunk_k, weights, indices, scale)
  assert rel_err(lse[:, :, :, :query_len], reference_lse) < 1e-3, rel_err(lse[:, :, :, :query_len], reference_lse)

  # The Triton forward on the same padded inputs: same layout and units of the log-normalizers.
  triton_out = jax.jit(lambda *a: gca_attention(*a, implementation="triton"))(*inputs)
  assert rel_err(out, triton_out.astype(jnp.float32)) < 1e-2
  if query_len % 64 == 0:
    tiling = tiling_for(query_len, shape["heads"] // shape["kv_heads"], shape["chunk_len"], default_triton_config())
    batch, seq, heads, head_dim = q.shape
    queries = q.reshape(batch, shape["query_chunks"], query_len, heads, head_dim)
    padding = ((0, 0), (0, 0), (0, 64 - shape["chunk_len"]), (0, 0), (0, 0))
    memory_chunks = chunk_k.shape[1]
    _, triton_lse = triton_kernels.forward(
      queries,
      jnp.pad(chunk_k, padding),
      jnp.pad(chunk_v, padding),
      weights,
      jnp.clip(indices, 0, memory_chunks - 1),
      tiling=tiling,
      scale=scale,
      config=default_triton_config(),
      interpret=True,
    )
    assert triton_lse.shape == lse.shape
    assert rel_err(lse, triton_lse) < 1e-3, rel_err(lse, triton_lse)


@pytest.mark.parametrize("head_dim, stages", [(64, 2), (64, 3), (128, 4), (128, 3)])
def test_lowers_for_hopper_at_the_drt_shape(head_dim, stages):
  """The Mosaic GPU lowering (layouts, wgmma shapes incl. P from registers, TMA gathers) for
  an H100 at drt_128m's shape; the shared memory it allocates matches the module's estimate
  (plus the lowering's 2 KiB reduction scratch) and fits an H100 block."""
  queries, keys, values, weights, indices, _ = drt_padded_structs(**dict(DRT_128M, head_dim=head_dim))
  forward = lambda *a: mosaic_forward.forward(*a, chunk_len=DRT_128M["chunk_len"], scale=head_dim**-0.5, stages=stages)
  text, shared_memory = lower_for_hopper(forward, (queries, keys, values, weights, indices))
  assert "mosaic_gpu" in text
  estimate = mosaic_forward.shared_memory_bytes(head_dim, DRT_128M["top_k"], jnp.bfloat16, stages)
  assert estimate <= shared_memory <= estimate + 4096, (shared_memory, estimate)
  assert shared_memory <= H100_SHARED_MEMORY


def test_a_deeper_ring_matches_the_default_one():
  """k = 5 slots through 3 buffers (refilled late) computes what 2 buffers do, and both
  match the XLA path."""
  shape = dict(MOSAIC_CASES["bf16"][0], top_k=5)
  inputs = gca_inputs(1, **shape)
  scale = shape["head_dim"] ** -0.5
  deeper = mosaic_forward.gca_forward_mosaic(*inputs, scale=scale, stages=3, interpret=True)
  default = mosaic_forward.gca_forward_mosaic(*inputs, scale=scale, stages=2, interpret=True)
  for a, b in zip(deeper, default):
    assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < 1e-6
  inputs32 = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs)
  reference = jax.jit(lambda *a: gca_attention(*a, implementation="xla"))(*inputs32)
  assert rel_err(deeper[0].astype(jnp.float32), reference) < 1e-2


def _small(**changes):
  shape = dict(MOSAIC_CASES["bf16"][0], query_chunks=1, top_k=2)
  shape.update(changes)
  return gca_inputs(0, **shape)


@pytest.mark.parametrize(
  "inputs, stages, message",
  [
    (_small(dtype=jnp.float32), 2, "got dtype float32"),
    (_small(head_dim=32), 2, "head_dim in \\(64, 128\\) \\(last axis of q\\), got 32"),
    (_small(chunk_len=65, memory_chunks=3), 2, "chunk_len, axis 2 of chunk_k\\), got 65"),
    (_small(heads=3, kv_heads=2), 2, "heads \\(3\\) must be a multiple of kv_heads \\(2"),
    (_small(), 0, "stages must be an int >= 1"),
  ],
)
def test_rejects_what_the_kernel_cannot_take(inputs, stages, message):
  with pytest.raises(ValueError, match=message):
    mosaic_forward.gca_forward_mosaic(*inputs, scale=0.125, stages=stages, interpret=True)


def test_forward_native_rejects_unpadded_rows():
  q, chunk_k, chunk_v, weights, indices = _small()
  queries = q.reshape(1, 1, 64, 2, 64)[:, :, :48]
  padding = ((0, 0), (0, 0), (0, 1), (0, 0), (0, 0))
  with pytest.raises(ValueError, match="multiple of 64 rows \\(query_rows\\), got 48"):
    mosaic_forward.forward(
      queries,
      jnp.pad(chunk_k, padding),
      jnp.pad(chunk_v, padding),
      weights,
      indices,
      chunk_len=63,
      scale=0.125,
      interpret=plgpu.InterpretGPUParams(),
    )
