"""What every GCA implementation must pass, and the inputs the GCA tests share: random
retrievals with one chunk read twice by a query chunk, an empty slot (weight 0), a chunk
every query chunk reads and an out-of-range index (clipped), and the comparison of an output
and its four gradients (q, chunk_k, chunk_v, chunk_weights) with autodiff of the reference
(`gca_reference`, float32: the oracle of the chain of trust); and the small float32 inputs
of the reference and XLA tests with a direct float64 loop; the GPU tests' causal retrievals;
the Mosaic tests' cases and their H100 lowering at the drt_128m shape."""

import itertools

import jax
from jax._src.pallas.mosaic_gpu import lowering as mosaic_lowering
import jax.numpy as jnp
import numpy as np

from castle_jax.ops.gca import gca_reference, retrieval_scores, select_chunks
from helpers import lowered_for_h100, rel_err

NAMES = ("q", "chunk_k", "chunk_v", "chunk_weights")
# bf16 shapes every implementation takes (the Mosaic kernels: head dim 64 or 128, memory
# chunks of at most 64 keys): drt_128m's per-chunk sizes, and grouped heads at head dim 128
# with query chunks of two 64-row tiles.
CASES = {
  "drt": dict(
    batch=1, query_chunks=2, query_len=64, heads=2, kv_heads=2, head_dim=64, memory_chunks=3, chunk_len=63, top_k=2
  ),
  "grouped_128": dict(
    batch=1, query_chunks=2, query_len=65, heads=4, kv_heads=2, head_dim=128, memory_chunks=4, chunk_len=64, top_k=3
  ),
}


def random_inputs(
  seed,
  *,
  batch,
  query_chunks,
  query_len,
  heads,
  kv_heads,
  head_dim,
  memory_chunks,
  chunk_len,
  top_k,
  dtype,
  indices_below,
):
  """Random (q, chunk_k, chunk_v) in `dtype` (drawn in float32), softmax slot weights and
  chunk indices in [0, indices_below)."""
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (batch, query_chunks * query_len, heads, head_dim), jnp.float32)
  chunk_k = jax.random.normal(keys[1], (batch, memory_chunks, chunk_len, kv_heads, head_dim), jnp.float32)
  chunk_v = jax.random.normal(keys[2], (batch, memory_chunks, chunk_len, kv_heads, head_dim), jnp.float32)
  weights = jax.nn.softmax(jax.random.normal(keys[3], (batch, query_chunks, top_k)), axis=-1)
  indices = jax.random.randint(keys[4], (batch, query_chunks, top_k), 0, indices_below)
  return q.astype(dtype), chunk_k.astype(dtype), chunk_v.astype(dtype), weights, indices


def gca_inputs(seed, *, memory_chunks, dtype, **shape):
  q, chunk_k, chunk_v, weights, indices = random_inputs(
    seed, memory_chunks=memory_chunks, dtype=dtype, indices_below=memory_chunks - 1, **shape
  )
  # Query chunk 0: one chunk twice and an empty last slot; every query chunk reads chunk 1
  # in slot 0; the last query chunk's last index is out of range (clipped to the last chunk).
  indices = indices.at[:, 0, 1].set(indices[:, 0, 0]).at[:, 1:, 0].set(1).at[:, -1, -1].set(memory_chunks + 5)
  weights = weights.at[:, 0, -1].set(0.0)
  return q, chunk_k, chunk_v, weights, indices


def assert_matches_the_reference(attention, inputs, cotangent, tol=1e-2):
  """attention(q, chunk_k, chunk_v, chunk_weights, chunk_indices)'s output and four gradients
  under `cotangent` against autodiff of the float32 reference."""
  *differentiable, indices = inputs

  def value_and_grads(fn, args):
    loss = lambda *a: jnp.sum(fn(*a, indices).astype(jnp.float32) * cotangent)
    return jax.jit(lambda *a: fn(*a, indices))(*args), jax.jit(jax.grad(loss, argnums=range(4)))(*args)

  out, grads = value_and_grads(attention, differentiable)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_grads = value_and_grads(gca_reference, [x.astype(jnp.float32) for x in differentiable])
  assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape
  assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)
  for name, grad, ref in zip(NAMES, grads, ref_grads):
    assert rel_err(grad, ref) < tol, (name, rel_err(grad, ref))


# The reference and XLA tests' float32 shape: grouped heads, query chunks of 5 rows.
SMALL = dict(
  batch=2, query_chunks=3, query_len=5, heads=4, kv_heads=2, head_dim=8, memory_chunks=4, chunk_len=6, top_k=3
)


def small_inputs(seed, *, dtype=jnp.float32, **changes):
  """`random_inputs` at SMALL's shape with `changes`, every chunk index in range."""
  shape = {**SMALL, **changes}
  return random_inputs(seed, dtype=dtype, indices_below=shape["memory_chunks"], **shape)


def direct_gca(q, chunk_k, chunk_v, weights, indices):
  """Loops over every (batch, query chunk, slot, head, row) in float64 numpy."""
  q, chunk_k, chunk_v, weights = (np.asarray(x, np.float64) for x in (q, chunk_k, chunk_v, weights))
  indices = np.asarray(indices)
  batch, seq, heads, head_dim = q.shape
  query_chunks, top_k = indices.shape[1:]
  query_len, group = seq // query_chunks, heads // chunk_k.shape[3]
  out = np.zeros_like(q)
  for b, c, j, h in itertools.product(range(batch), range(query_chunks), range(top_k), range(heads)):
    keys = chunk_k[b, indices[b, c, j], :, h // group]
    values = chunk_v[b, indices[b, c, j], :, h // group]
    for i in range(query_len):
      row = c * query_len + i
      e = np.exp(keys @ q[b, row, h] / np.sqrt(head_dim))
      out[b, row, h] += weights[b, c, j] * (e / (1.0 + e.sum())) @ values
  return out


def causal_inputs(seed, *, batch, query_chunks, query_len, heads, kv_heads, head_dim, chunk_len, top_k, dtype):
  """GCA inputs with retrievals from `select_chunks` over causal scores, as in DRT (empty
  slots in the first query chunks, early memory chunks read by many), and a float32 cotangent."""
  q, chunk_k, chunk_v, _, _ = random_inputs(
    seed,
    batch=batch,
    query_chunks=query_chunks,
    query_len=query_len,
    heads=heads,
    kv_heads=kv_heads,
    head_dim=head_dim,
    memory_chunks=query_chunks,
    chunk_len=chunk_len,
    top_k=top_k,
    dtype=dtype,
    indices_below=1,
  )
  keys = jax.random.split(jax.random.key(seed + 1), 4)
  landmarks = jax.random.normal(keys[0], (batch, query_chunks, 32), jnp.float32)
  states = jax.random.normal(keys[1], (batch, query_chunks, 32), jnp.float32)
  indices, weights = select_chunks(retrieval_scores(states, landmarks), top_k, gumbel_rng=keys[2])
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
  return (q, chunk_k, chunk_v, weights, indices), cotangent


# An H100 block gets at most 227 KiB of shared memory.
H100_SHARED_MEMORY = 227 * 1024

# The Mosaic kernel tests' (shape, ring stages) cases.
MOSAIC_CASES = {
  # drt_128m's per-head shape (64 query rows, 63-key chunks), plain heads, bf16, a
  # two-stage ring refilled for the third slot.
  "bf16": (
    dict(
      batch=1,
      query_chunks=3,
      query_len=64,
      heads=2,
      kv_heads=2,
      head_dim=64,
      memory_chunks=4,
      chunk_len=63,
      top_k=3,
      dtype=jnp.bfloat16,
    ),
    2,
  ),
  # grouped heads, two 64-row tiles per query chunk (65 rows), head dim 128, float16,
  # one ring buffer reused by every slot.
  "f16_grouped": (
    dict(
      batch=1,
      query_chunks=2,
      query_len=65,
      heads=4,
      kv_heads=2,
      head_dim=128,
      memory_chunks=3,
      chunk_len=40,
      top_k=2,
      dtype=jnp.float16,
    ),
    1,
  ),
}


DRT_128M = dict(batch=4, tokens=16384, heads=12, head_dim=64, chunk_len=63, top_k=8)


def drt_padded_structs(*, batch, tokens, heads, head_dim, chunk_len, top_k):
  """Shape structs of the padded bf16 kernel inputs at drt_128m's shape: (queries [b, c, 64, h,
  d], keys/values [b, c, 64, h, d], weights, indices, per-slot rows [b, c, k, 64, h])."""
  query_chunks = tokens // chunk_len
  struct = jax.ShapeDtypeStruct
  tile = struct((batch, query_chunks, 64, heads, head_dim), jnp.bfloat16)
  slots = struct((batch, query_chunks, top_k), jnp.float32)
  return (
    tile,
    tile,
    tile,
    slots,
    struct(slots.shape, jnp.int32),
    struct((batch, query_chunks, top_k, 64, heads), jnp.float32),
  )


def lower_for_hopper(function, args):
  """Lowers `function(*args)` for an H100 (no GPU needed); returns (HLO text, shared memory
  bytes the Mosaic lowering allocates for one program of its last kernel)."""
  allocations = []
  estimate_resources = mosaic_lowering._estimate_resources

  def recording(*a, **kw):
    resources = estimate_resources(*a, **kw)
    allocations.append(resources.smem_scratch_bytes)
    return resources

  mosaic_lowering._estimate_resources = recording
  try:
    text = lowered_for_h100(function, args)
  finally:
    mosaic_lowering._estimate_resources = estimate_resources
  return text, allocations[-1]
