"""The compiled GCA Mosaic GPU kernels on a Hopper GPU at real sizes (skipped without one).

Outputs against the XLA path computing in float32 with full-precision matmuls, and the
per-slot log-normalizers against the Triton forward's (same layout and units, so the
Triton backward can consume them): the drt_128m shape (12 heads x 64, query chunks of 63
tokens + a landmark = 64 positions, memory chunks of 63 keys, k = 8) in bf16 with the
default ring and a deeper one, and grouped heads at head dim 128 with 65-position query
chunks (two 64-row tiles each). Retrievals come from `select_chunks` over causal scores, as
in DRT: the first query chunks have empty slots (weight 0, index 0) and early memory chunks
are retrieved by many query chunks. The query-side backward (dQ, delta, dw) against the
compiled Triton `triton_kernels.backward_queries` on the same inputs and against autodiff of the
XLA path. The memory-side backward (dK, dV) against the compiled Triton
`triton_kernels.backward_memory` on the same log-normalizers and deltas and against XLA autodiff, and
it is deterministic. `gca_attention_mosaic`'s output and four gradients against XLA autodiff,
and `gca_attention(implementation="triton")` on Hopper: the default backend runs the Mosaic
kernels, "triton" the Triton ones.
"""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.gca import gca_attention
from helpers import rel_err
from pallas_kernels.gca import triton_kernels, mosaic_backward_memory, mosaic_backward_queries, mosaic_forward
from pallas_kernels.gca.config import default_triton_config
from pallas_kernels.gca.mosaic import gca_attention_mosaic
from pallas_kernels.gca.mosaic_forward import CHUNK_TILE, gca_forward_mosaic
from pallas_kernels.gca.triton import tiling_for
from pallas_kernels.gca.pairs import retrieving_pairs
from ops.gca.base import causal_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("full_float32_matmuls")]


def _is_hopper() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _inputs(seed, **shape):
  """`base.causal_inputs` (causal `select_chunks` retrievals), without the cotangent."""
  return causal_inputs(seed, **shape)[0]


def _padded(inputs, *, query_chunks, query_len, heads, head_dim, chunk_len, **_):
  """The kernels' padded arrays (query_len a multiple of 64, so that no query rows are padded)."""
  q, chunk_k, chunk_v, weights, indices = inputs
  padding = ((0, 0), (0, 0), (0, CHUNK_TILE - chunk_len), (0, 0), (0, 0))
  queries = q.reshape(q.shape[0], query_chunks, query_len, heads, head_dim)
  return (
    queries,
    jnp.pad(chunk_k, padding),
    jnp.pad(chunk_v, padding),
    weights,
    jnp.clip(indices, 0, chunk_k.shape[1] - 1),
  )


def _triton_tiling(shape):
  return tiling_for(
    shape["query_len"], shape["heads"] // shape["kv_heads"], shape["chunk_len"], default_triton_config()
  )


def _triton_lse(inputs, shape):
  """The Triton forward's log-normalizers [batch, query_chunks, k, query_len, heads]."""
  forward = jax.jit(
    lambda *a: triton_kernels.forward(
      *a, tiling=_triton_tiling(shape), scale=shape["head_dim"] ** -0.5, config=default_triton_config(), interpret=False
    )[1]
  )
  return forward(*_padded(inputs, **shape))


DRT_128M = dict(batch=2, query_chunks=64, query_len=64, heads=12, kv_heads=12, head_dim=64, chunk_len=63, top_k=8)


@pytest.mark.parametrize(
  "shape, stages",
  [
    (DRT_128M, 2),
    (DRT_128M, 3),
    (dict(batch=1, query_chunks=32, query_len=65, heads=8, kv_heads=2, head_dim=128, chunk_len=64, top_k=4), 2),
  ],
)
def test_compiled_forward_matches_the_xla_path(shape, stages):
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper (sm_90) GPU")
  inputs = _inputs(0, **shape, dtype=jnp.bfloat16)
  scale = shape["head_dim"] ** -0.5
  out, lse = jax.jit(lambda *a: gca_forward_mosaic(*a, scale=scale, stages=stages))(*inputs)
  inputs32 = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs)
  reference = jax.jit(lambda *a: gca_attention(*a, implementation="xla"))(*inputs32)
  assert out.dtype == jnp.bfloat16 and out.shape == inputs[0].shape
  assert rel_err(out, reference) < 1e-2, rel_err(out, reference)
  if shape["query_len"] % 64 == 0:
    triton_lse = _triton_lse(inputs, shape)
    assert lse.shape == triton_lse.shape
    assert rel_err(lse, triton_lse) < 1e-3, rel_err(lse, triton_lse)


def test_compiled_forward_is_deterministic():
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper (sm_90) GPU")
  inputs = _inputs(1, **DRT_128M, dtype=jnp.bfloat16)
  forward = jax.jit(lambda *a: gca_forward_mosaic(*a, scale=DRT_128M["head_dim"] ** -0.5))
  first, second = forward(*inputs), forward(*inputs)
  for a, b in zip(first, second):
    assert bool(jnp.all(a == b))


@pytest.mark.parametrize("stages", [2, 3])
def test_compiled_backward_queries_matches_triton_and_xla(stages):
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper (sm_90) GPU")
  shape = DRT_128M
  inputs = _inputs(2, **shape, dtype=jnp.bfloat16)
  q = inputs[0]
  d_out = jax.random.normal(jax.random.key(3), q.shape, jnp.float32).astype(q.dtype)
  scale = shape["head_dim"] ** -0.5
  padded = _padded(inputs, **shape)
  d_out_padded = d_out.reshape(padded[0].shape)
  options = dict(chunk_len=shape["chunk_len"], scale=scale, stages=stages)
  _, lse = jax.jit(lambda *a: mosaic_forward.forward(*a, **options))(*padded)
  d_queries, delta, d_weights = jax.jit(lambda *a: mosaic_backward_queries.backward_queries(*a, **options))(
    *padded, lse, d_out_padded
  )
  triton = jax.jit(
    lambda *a: triton_kernels.backward_queries(
      *a, tiling=_triton_tiling(shape), scale=scale, config=default_triton_config(), interpret=False
    )
  )(*padded, lse, d_out_padded)
  for name, ours, theirs, tol in zip(
    ("d_queries", "delta", "d_weights"), (d_queries, delta, d_weights), triton, (1e-2, 2e-3, 2e-3)
  ):
    assert ours.shape == theirs.shape, name
    assert rel_err(ours, theirs) < tol, (name, rel_err(ours, theirs))

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
  assert rel_err(d_queries.reshape(q.shape), ref_d_q) < 1e-2
  assert rel_err(d_weights, ref_d_w) < 1e-2


# The grouped head-dim-128 case is past the Triton memory-side kernel's shared memory (it
# asks for ~570 KB), so there the XLA path is the only reference.
@pytest.mark.parametrize(
  "shape, stages, against_triton",
  [
    (DRT_128M, 2, True),
    (DRT_128M, 3, True),
    (dict(batch=1, query_chunks=32, query_len=128, heads=8, kv_heads=2, head_dim=128, chunk_len=64, top_k=4), 2, False),
  ],
)
def test_compiled_backward_memory_matches_triton_and_xla(shape, stages, against_triton):
  """dK and dV at drt_128m's shape (early chunks retrieved by many query chunks, some by none)
  and with grouped heads, two query tiles per chunk and head dim 128."""
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper (sm_90) GPU")
  inputs = _inputs(6, **shape, dtype=jnp.bfloat16)
  q, chunk_k, chunk_v, weights, indices = inputs
  d_out = jax.random.normal(jax.random.key(7), q.shape, jnp.float32).astype(q.dtype)
  scale = shape["head_dim"] ** -0.5
  padded = _padded(inputs, **shape)
  queries, keys, values, weights, indices = padded
  d_out_padded = d_out.reshape(queries.shape)
  options = dict(chunk_len=shape["chunk_len"], scale=scale, stages=stages)

  @jax.jit
  def mosaic(*padded):
    _, lse = mosaic_forward.forward_native(*padded, **options)
    _, row_dots = mosaic_backward_queries.backward_queries_native(*padded, lse, d_out_padded, **options)
    order, starts = retrieving_pairs(padded[4], padded[3], padded[1].shape[1])
    gradients = mosaic_backward_memory.backward_memory_native(
      *padded[:4], lse, row_dots, d_out_padded, order, starts, **options
    )
    return gradients, lse, row_dots, order, starts

  (d_keys, d_values), lse, row_dots, order, starts = mosaic(*padded)
  again = mosaic(*padded)[0]
  assert bool(jnp.all(again[0] == d_keys)) and bool(jnp.all(again[1] == d_values)), "not deterministic"

  if against_triton:
    to_triton = lambda slot_rows: slot_rows.transpose(0, 1, 3, 4, 2)
    delta = to_triton(row_dots * weights[:, :, None, :, None])
    triton = jax.jit(
      lambda *a: triton_kernels.backward_memory(
        *a, tiling=_triton_tiling(shape), scale=scale, config=default_triton_config(), interpret=False
      )
    )(queries, keys, values, weights, to_triton(lse), delta, d_out_padded, order, starts)
    # dV: the kernel rounds w_j P to bf16, the Triton kernel P (then scales the product by w_j).
    for name, ours, theirs, tol in zip(("d_keys", "d_values"), (d_keys, d_values), triton, (2e-3, 1e-2)):
      assert ours.shape == theirs.shape, name
      assert rel_err(ours, theirs) < tol, (name, rel_err(ours, theirs))

  f32 = lambda x: x.astype(jnp.float32)
  grad = jax.jit(
    jax.grad(
      lambda k, v: jnp.sum(gca_attention(f32(q), k, v, inputs[3], inputs[4], implementation="xla") * f32(d_out)),
      argnums=(0, 1),
    )
  )
  ref_d_keys, ref_d_values = grad(f32(chunk_k), f32(chunk_v))
  chunk_len = shape["chunk_len"]
  assert rel_err(d_keys[:, :, :chunk_len], ref_d_keys) < 1e-2, rel_err(d_keys[:, :, :chunk_len], ref_d_keys)
  assert rel_err(d_values[:, :, :chunk_len], ref_d_values) < 1e-2, rel_err(d_values[:, :, :chunk_len], ref_d_values)


def test_compiled_differentiable_op_matches_xla_autodiff():
  """`gca_attention_mosaic` (the three Mosaic kernels): output and the four gradients at the
  drt_128m shape."""
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper (sm_90) GPU")
  inputs = _inputs(4, **DRT_128M, dtype=jnp.bfloat16)
  *differentiable, indices = inputs
  cotangent = jax.random.normal(jax.random.key(5), inputs[0].shape, jnp.float32)

  def value_and_grads(attention, args):
    loss = lambda *a: jnp.sum(attention(*a, indices).astype(jnp.float32) * cotangent)
    return jax.jit(attention)(*args, indices), jax.jit(jax.grad(loss, argnums=range(4)))(*args)

  scale = DRT_128M["head_dim"] ** -0.5
  out, grads = value_and_grads(lambda *a: gca_attention_mosaic(*a, scale=scale), differentiable)
  ref_out, ref_grads = value_and_grads(
    lambda *a: gca_attention(*a, implementation="xla"), [x.astype(jnp.float32) for x in differentiable]
  )
  assert rel_err(out, ref_out) < 1e-2
  for name, grad, ref in zip(("q", "chunk_k", "chunk_v", "chunk_weights"), grads, ref_grads):
    assert rel_err(grad, ref) < 1e-2, (name, rel_err(grad, ref))


@pytest.mark.parametrize(
  "implementation, kernel", [(None, "mosaic_gpu"), ("mosaic", "mosaic_gpu"), ("triton", "gca_forward")]
)
def test_gca_attention_runs_the_chosen_kernels(implementation, kernel):
  """`gca_attention` at the drt_128m shape: the default runs the Mosaic kernels on Hopper,
  each explicit implementation its own; all match the XLA path."""
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernels need a Hopper (sm_90) GPU")
  inputs = _inputs(8, **DRT_128M, dtype=jnp.bfloat16)
  attention = jax.jit(lambda *a: gca_attention(*a, implementation=implementation))
  text = attention.lower(*inputs).as_text()
  assert kernel in text and ("gca_forward" in text) == (kernel == "gca_forward")
  reference = jax.jit(lambda *a: gca_attention(*a, implementation="xla"))(
    *(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs)
  )
  out = attention(*inputs)
  assert rel_err(out, reference) < 1e-2, rel_err(out, reference)
