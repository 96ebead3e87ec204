"""The GCA Mosaic GPU query-side backward (dQ, the deltas, dw) on CPU: GPU interpret mode and
the Mosaic lowering for an H100.

Against the Triton `triton_kernels.backward_queries` in interpret mode (same inputs, including the
log-normalizers: dQ, delta and dw in its layouts) and against autodiff of the XLA path in
float32 (dQ and dw: an independent implementation), with the retrievals of
`base.MOSAIC_CASES` (one chunk twice, an empty slot, an out-of-range index clipped) at
drt_128m's per-head shape and with grouped heads, two query tiles per chunk and head dim 128.
Then `gca_attention_mosaic` (the three Mosaic kernels, one custom VJP): output and all four
gradients against autodiff of the XLA path.
"""

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest

from castle_jax.ops.gca import gca_attention
from helpers import rel_err
from pallas_kernels.gca import triton_kernels, mosaic_backward_queries, mosaic_forward
from pallas_kernels.gca.mosaic import gca_attention_mosaic
from pallas_kernels.gca.config import default_triton_config
from pallas_kernels.gca.triton import tiling_for
from ops.gca.base import DRT_128M, H100_SHARED_MEMORY, MOSAIC_CASES, drt_padded_structs, gca_inputs, lower_for_hopper

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _padded(inputs, shape, query_rows):
  """The kernels' padded arrays: queries [b, c, query_rows, h, d], keys/values [b, m, 64, kv, d],
  indices clipped."""
  q, chunk_k, chunk_v, weights, indices = inputs
  batch, _, heads, head_dim = q.shape
  queries = q.reshape(batch, shape["query_chunks"], shape["query_len"], heads, head_dim)
  queries = jnp.pad(queries, ((0, 0), (0, 0), (0, query_rows - shape["query_len"]), (0, 0), (0, 0)))
  padding = ((0, 0), (0, 0), (0, mosaic_forward.CHUNK_TILE - shape["chunk_len"]), (0, 0), (0, 0))
  return (
    queries,
    jnp.pad(chunk_k, padding),
    jnp.pad(chunk_v, padding),
    weights,
    jnp.clip(indices, 0, chunk_k.shape[1] - 1),
  )


@pytest.mark.parametrize("case", list(MOSAIC_CASES))
def test_interpret_matches_triton_and_xla_gradients(case):
  shape, stages = MOSAIC_CASES[case]
  inputs = gca_inputs(0, **shape)
  q = inputs[0]
  d_out = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(q.dtype)
  scale = shape["head_dim"] ** -0.5
  query_rows = -(-shape["query_len"] // 64) * 64
  padded = _padded(inputs, shape, query_rows)
  d_out_padded = _padded((d_out,) + inputs[1:], shape, query_rows)[0]
  options = dict(chunk_len=shape["chunk_len"], scale=scale, stages=stages, interpret=plgpu.InterpretGPUParams())
  _, lse = mosaic_forward.forward(*padded, **options)
  d_queries, delta, d_weights = mosaic_backward_queries.backward_queries(*padded, lse, d_out_padded, **options)
  assert d_queries.dtype == q.dtype and d_queries.shape == padded[0].shape
  assert delta.shape == lse.shape and d_weights.shape == inputs[3].shape

  # Autodiff of the XLA path in float32 (padded query rows have zero cotangent: sliced off).
  f32 = lambda x: x.astype(jnp.float32)
  grad = jax.jit(
    jax.grad(
      lambda q32, w: jnp.sum(
        gca_attention(q32, f32(inputs[1]), f32(inputs[2]), w, inputs[4], implementation="xla") * f32(d_out)
      ),
      argnums=(0, 1),
    )
  )
  ref_d_q, ref_d_w = grad(f32(q), inputs[3])
  query_len = shape["query_len"]
  d_q = d_queries[:, :, :query_len].reshape(q.shape)
  # bf16/f16 operands (dO, dS rounded to them): errors ~2e-3.
  assert rel_err(d_q, ref_d_q) < 1e-2, rel_err(d_q, ref_d_q)
  assert rel_err(d_weights, ref_d_w) < 1e-2, rel_err(d_weights, ref_d_w)

  if query_len % 64 == 0:  # the Triton kernels' query tiles are then the same rows
    tiling = tiling_for(query_len, shape["heads"] // shape["kv_heads"], shape["chunk_len"], default_triton_config())
    triton = triton_kernels.backward_queries(
      *padded, lse, d_out_padded, tiling=tiling, scale=scale, config=default_triton_config(), interpret=True
    )
    for name, ours, theirs in zip(("d_queries", "delta", "d_weights"), (d_queries, delta, d_weights), triton):
      assert rel_err(ours, theirs) < 1e-3, (name, rel_err(ours, theirs))


@pytest.mark.parametrize("case", list(MOSAIC_CASES))
def test_differentiable_op_matches_xla_autodiff(case):
  shape, stages = MOSAIC_CASES[case]
  inputs = gca_inputs(0, **shape)
  *differentiable, indices = inputs
  cotangent = jax.random.normal(jax.random.key(2), inputs[0].shape, jnp.float32)
  scale = shape["head_dim"] ** -0.5

  def value_and_grads(attention, args):
    loss = lambda *a: jnp.sum(attention(*a, indices).astype(jnp.float32) * cotangent)
    return jax.jit(attention)(*args, indices), jax.jit(jax.grad(loss, argnums=range(4)))(*args)

  mosaic = lambda *a: gca_attention_mosaic(*a, scale=scale, stages=stages, interpret=True)
  out, grads = value_and_grads(mosaic, differentiable)
  f32 = [x.astype(jnp.float32) for x in differentiable]
  ref_out, ref_grads = value_and_grads(lambda *a: gca_attention(*a, implementation="xla"), f32)
  assert out.dtype == inputs[0].dtype and rel_err(out, ref_out) < 1e-2
  for name, grad, ref, x in zip(("q", "chunk_k", "chunk_v", "chunk_weights"), grads, ref_grads, differentiable):
    assert grad.dtype == x.dtype and grad.shape == x.shape, name
    assert rel_err(grad, ref) < 1e-2, (name, rel_err(grad, ref))


@pytest.mark.parametrize("head_dim, stages", [(64, 2), (128, 3)])
def test_lowers_for_hopper_at_the_drt_shape(head_dim, stages):
  queries, keys, values, weights, indices, lse = drt_padded_structs(**dict(DRT_128M, head_dim=head_dim))
  backward = lambda *a: mosaic_backward_queries.backward_queries(
    *a, chunk_len=DRT_128M["chunk_len"], scale=head_dim**-0.5, stages=stages
  )
  text, shared_memory = lower_for_hopper(backward, (queries, keys, values, weights, indices, lse, queries))
  assert "mosaic_gpu" in text
  estimate = mosaic_backward_queries.shared_memory_bytes(head_dim, DRT_128M["top_k"], jnp.bfloat16, stages)
  assert estimate <= shared_memory <= estimate + 4096, (shared_memory, estimate)
  assert shared_memory <= H100_SHARED_MEMORY


def test_rejects_mismatched_cotangent_and_log_normalizers():
  shape = dict(MOSAIC_CASES["bf16"][0], query_chunks=1, top_k=2)
  padded = _padded(gca_inputs(0, **shape), shape, 64)
  queries = padded[0]
  lse = jnp.zeros((1, 1, 2, 64, 2), jnp.float32)
  options = dict(chunk_len=63, scale=0.125, interpret=plgpu.InterpretGPUParams())
  with pytest.raises(ValueError, match="d_out must be shaped like queries"):
    mosaic_backward_queries.backward_queries(*padded, lse, queries[:, :, :32], **options)
  with pytest.raises(ValueError, match="head_dim in"):
    mosaic_backward_queries.backward_queries(
      *(x[..., :32] if x.ndim == 5 else x for x in padded), lse, queries[..., :32], **options
    )
