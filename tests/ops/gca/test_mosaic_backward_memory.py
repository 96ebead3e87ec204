"""The GCA Mosaic GPU memory-side backward (dK, dV) on CPU: GPU interpret mode and the
Mosaic lowering for an H100.

Against the Triton `triton_kernels.backward_memory` in interpret mode (same inputs: the Mosaic
forward's log-normalizers and the query side's row dots, turned into the Triton layouts and
deltas) and against autodiff of the XLA path in float32 (an independent implementation).
The retrievals are laid out by hand so that one memory chunk is retrieved by several query
chunks and twice by one of them, one by none, and one only by an empty slot (weight 0,
which contributes nothing and is left out of the pair list); a ring of one buffer and one
shallower than the steps (refilled inside the dynamic loop), grouped heads with two 64-row
tiles per query chunk (65 rows, zero-padded) and head dim 128. Then the lowering at the
drt_128m shape and the shared memory it allocates, and bad inputs.
"""

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.gca import gca_attention
from helpers import rel_err
from pallas_kernels.gca import triton_kernels, mosaic_backward_memory, mosaic_backward_queries, mosaic_forward
from pallas_kernels.gca.config import default_triton_config
from pallas_kernels.gca.mosaic_tiles import CHUNK_TILE, TILE_ROWS, pad_inputs
from pallas_kernels.gca.pairs import retrieving_pairs
from ops.gca.base import DRT_128M, H100_SHARED_MEMORY, lower_for_hopper

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

# Query chunk 0 reads chunk 2 twice; chunk 2 is read by every query chunk (4 pairs), chunk 3
# by none, chunk 4 only by query chunk 2's last slot, whose weight is 0.
INDICES = [[2, 2, 0], [1, 0, 2], [1, 2, 4]]
NOBODY, EMPTY_SLOT_ONLY = 3, 4

CASES = {
  # drt_128m's per-head shape (64 query rows, 63-key chunks), bf16; 2 buffers for up to 4 steps.
  "bf16": (dict(heads=2, kv_heads=2, query_len=64, head_dim=64, chunk_len=63, dtype=jnp.bfloat16), 2),
  # grouped heads (2 per kv head), two 64-row tiles per query chunk: up to 16 steps through 1 buffer.
  "f16_grouped": (dict(heads=2, kv_heads=1, query_len=65, head_dim=128, chunk_len=40, dtype=jnp.float16), 1),
}


def _inputs(*, heads, kv_heads, query_len, head_dim, chunk_len, dtype):
  query_chunks, top_k = len(INDICES), len(INDICES[0])
  memory_chunks = 5
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (1, query_chunks * query_len, heads, head_dim), jnp.float32)
  chunk_k = jax.random.normal(keys[1], (1, memory_chunks, chunk_len, kv_heads, head_dim), jnp.float32)
  chunk_v = jax.random.normal(keys[2], (1, memory_chunks, chunk_len, kv_heads, head_dim), jnp.float32)
  weights = jax.nn.softmax(jax.random.normal(keys[3], (1, query_chunks, top_k)), axis=-1).at[0, 2, 2].set(0.0)
  d_out = jax.random.normal(keys[4], q.shape, jnp.float32)
  cast = lambda x: x.astype(dtype)
  return cast(q), cast(chunk_k), cast(chunk_v), weights, jnp.array([INDICES], jnp.int32), cast(d_out)


def _kernel_gradients(inputs, shape, stages):
  """(d_keys, d_values) of the Mosaic kernel, and of the Triton kernel on the same inputs."""
  *attention_inputs, d_out = inputs
  padded = pad_inputs(*attention_inputs, stages=stages)
  queries, keys, values, weights, indices = padded.arrays
  query_rows = queries.shape[2]
  d_out_padded = pad_inputs(d_out, *attention_inputs[1:], stages=stages).arrays[0]
  options = dict(
    chunk_len=shape["chunk_len"], scale=shape["head_dim"] ** -0.5, stages=stages, interpret=plgpu.InterpretGPUParams()
  )
  _, lse = mosaic_forward.forward_native(*padded.arrays, **options)
  _, row_dots = mosaic_backward_queries.backward_queries_native(*padded.arrays, lse, d_out_padded, **options)
  order, starts = retrieving_pairs(indices, weights, keys.shape[1])
  ours = mosaic_backward_memory.backward_memory_native(
    queries, keys, values, weights, lse, row_dots, d_out_padded, order, starts, **options
  )

  # The Triton kernel over the same whole 64-row tiles, deltas w_j r_j in its layout.
  to_triton = lambda slot_rows: slot_rows.transpose(0, 1, 3, 4, 2)
  tiling = triton_kernels.Tiling(
    query_len=query_rows,
    block_q=TILE_ROWS,
    heads_per_program=1,
    group=shape["heads"] // shape["kv_heads"],
    chunk_len=shape["chunk_len"],
    padded_chunk_len=CHUNK_TILE,
  )
  delta = to_triton(row_dots * weights[:, :, None, :, None])
  theirs = triton_kernels.backward_memory(
    queries,
    keys,
    values,
    weights,
    to_triton(lse),
    delta,
    d_out_padded,
    order,
    starts,
    tiling=tiling,
    scale=options["scale"],
    config=default_triton_config(),
    interpret=True,
  )
  return ours, theirs


@pytest.mark.parametrize("case", list(CASES))
def test_interpret_matches_triton_and_xla_autodiff(case):
  shape, stages = CASES[case]
  inputs = _inputs(**shape)
  q, chunk_k, chunk_v, weights, indices, d_out = inputs
  (d_keys, d_values), triton = _kernel_gradients(inputs, shape, stages)
  assert d_keys.shape == d_values.shape == (*chunk_k.shape[:2], CHUNK_TILE, *chunk_k.shape[3:])
  assert d_keys.dtype == d_values.dtype == chunk_k.dtype
  # dK's operands are rounded alike (~1e-5 apart); dV's are not: the kernel rounds w_j P to the
  # operand dtype, the Triton kernel rounds P and multiplies the product by w_j (~3e-3 in bf16).
  for name, ours, theirs, tolerance in zip(("d_keys", "d_values"), (d_keys, d_values), triton, (1e-4, 1e-2)):
    assert rel_err(ours, theirs) < tolerance, (name, rel_err(ours, theirs))

  f32 = lambda x: x.astype(jnp.float32)
  grad = jax.jit(
    jax.grad(
      lambda k, v: jnp.sum(gca_attention(f32(q), k, v, weights, indices, implementation="xla") * f32(d_out)),
      argnums=(0, 1),
    )
  )
  ref_d_keys, ref_d_values = grad(f32(chunk_k), f32(chunk_v))
  chunk_len = shape["chunk_len"]
  for name, ours, ref in zip(("d_keys", "d_values"), (d_keys, d_values), (ref_d_keys, ref_d_values)):
    ours = np.asarray(ours.astype(jnp.float32))
    # bf16/f16 operands (dO, wP, dS rounded to them): errors ~2e-3.
    assert rel_err(ours[:, :, :chunk_len], ref) < 1e-2, (name, rel_err(ours[:, :, :chunk_len], ref))
    assert not ours[:, :, chunk_len:].any(), f"{name}: padded keys"
    assert not ours[:, NOBODY].any() and not ours[:, EMPTY_SLOT_ONLY].any(), f"{name}: chunks nobody retrieved"
    assert np.abs(ours[:, 2]).max() > 0


def test_lowers_for_hopper_at_the_drt_shape():
  """The Mosaic GPU lowering for an H100 at drt_128m's shape (dynamic step loop, TMA gathers by
  index, register operands, in-place accumulators) and the shared memory it allocates."""
  batch, tokens, heads, head_dim, chunk_len, top_k = (
    DRT_128M[k] for k in ("batch", "tokens", "heads", "head_dim", "chunk_len", "top_k")
  )
  chunks = tokens // chunk_len
  struct = jax.ShapeDtypeStruct
  for dim, stages in ((head_dim, 2), (128, 3)):
    tile = struct((batch, chunks, TILE_ROWS, heads, dim), jnp.bfloat16)
    slot_rows = struct((batch, chunks, heads, top_k, TILE_ROWS), jnp.float32)
    args = (
      tile,
      tile,
      tile,
      struct((batch, chunks, top_k), jnp.float32),
      slot_rows,
      slot_rows,
      tile,
      struct((batch, chunks * top_k), jnp.int32),
      struct((batch, chunks + 1), jnp.int32),
    )
    backward = lambda *a: mosaic_backward_memory.backward_memory_native(
      *a, chunk_len=chunk_len, scale=dim**-0.5, stages=stages
    )
    text, shared_memory = lower_for_hopper(backward, args)
    assert "mosaic_gpu" in text
    estimate = mosaic_backward_memory.shared_memory_bytes(dim, jnp.bfloat16, stages)
    assert estimate <= shared_memory <= estimate + 4096, (dim, shared_memory, estimate)
    assert shared_memory <= H100_SHARED_MEMORY


def test_rejects_bad_inputs():
  shape = CASES["bf16"][0]
  *attention_inputs, d_out = _inputs(**shape)
  queries, keys, values, weights, indices = pad_inputs(*attention_inputs, stages=2).arrays
  slot_rows = jnp.zeros((1, 3, 2, 3, TILE_ROWS), jnp.float32)
  order, starts = retrieving_pairs(indices, weights, keys.shape[1])
  call = lambda *a, **kw: mosaic_backward_memory.backward_memory_native(
    *a, **dict(dict(chunk_len=63, scale=0.125, interpret=plgpu.InterpretGPUParams()), **kw)
  )
  with pytest.raises(ValueError, match="lse and row_dots"):
    call(queries, keys, values, weights, slot_rows[..., :32], slot_rows, queries, order, starts)
  with pytest.raises(ValueError, match="d_out must be shaped like queries"):
    call(queries, keys, values, weights, slot_rows, slot_rows, queries[:, :, :32], order, starts)
  with pytest.raises(ValueError, match="starts"):
    call(queries, keys, values, weights, slot_rows, slot_rows, queries, order, starts[:, :-1])
  with pytest.raises(ValueError, match="got dtype float32"):
    f32 = lambda x: x.astype(jnp.float32)
    call(f32(queries), f32(keys), f32(values), weights, slot_rows, slot_rows, f32(queries), order, starts)
  with pytest.raises(ValueError, match="stages must be an int >= 1"):
    call(queries, keys, values, weights, slot_rows, slot_rows, queries, order, starts, stages=0)
