"""What the GCA Mosaic GPU kernels share: sizes and input checks, the program's coordinates,
the ring of gathered K/V tiles, products issued together, and the launch.

The query-side kernels (`mosaic_forward`, `mosaic_backward_queries`) run one program per
(batch * head, 64-row query tile), one warpgroup, the grid's last axis (launched fastest)
the query tile, and stream the k retrieved chunks' K and V tiles through a ring of
shared-memory buffers, each tile gathered by TMA straight from the whole memory by its
index. The slots are unrolled (k is small, 8 in DRT), so ring buffers and per-slot rows
are picked statically. The memory-side backward (`mosaic_backward_memory`) runs one program
per (batch * kv head, memory chunk) and shares the checks, the key mask, the products and
the launch.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

# Shared with the CASTLE Mosaic kernels: the TMA/wgmma shared-memory layout.
from pallas_kernels.mosaic_common import operand_smem
from pallas_kernels.mosaic_compiler_params import compiler_params
from pallas_kernels.gca import padding

TILE_ROWS = 64  # query rows per program: one warpgroup's wgmma rows
CHUNK_TILE = 64  # keys per memory-chunk tile (chunks padded to it)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
DEFAULT_STAGES = 2


def unsupported_reason(
  *, head_dim: int, chunk_len: int, query_rows: int, heads: int, kv_heads: int, dtype, stages: int = DEFAULT_STAGES
) -> str | None:
  """Why the Mosaic kernels cannot take inputs of these sizes (naming the argument and the
  fix), or None. `query_rows` are the (padded) rows per query chunk the kernels see."""
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"the GCA Mosaic kernels take q in {[jnp.dtype(d).name for d in SUPPORTED_DTYPES]} (wgmma's 16-bit "
      f"operands), got dtype {jnp.dtype(dtype).name}; cast q, chunk_k and chunk_v or use the Triton kernels "
      "(implementation='triton')"
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return (
      f"the GCA Mosaic kernels take head_dim in {SUPPORTED_HEAD_DIMS} (last axis of q), got {head_dim}; use "
      "the Triton kernels (implementation='triton')"
    )
  if not 1 <= chunk_len <= CHUNK_TILE:
    return (
      f"the GCA Mosaic kernels take memory chunks of 1..{CHUNK_TILE} keys (chunk_len, axis 2 of chunk_k), "
      f"got {chunk_len}; use the Triton kernels (implementation='triton')"
    )
  if query_rows % TILE_ROWS:
    return (
      f"the GCA Mosaic kernels need query chunks padded to a multiple of {TILE_ROWS} rows (query_rows), got "
      f"{query_rows}; pad them (gca_forward_mosaic does)"
    )
  if kv_heads < 1 or heads % kv_heads:
    return f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}, axis 3 of chunk_k)"
  if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
    return f"stages must be an int >= 1 (ring depth of K/V tiles), got {stages!r}"
  return None


def check_padded(queries, keys, values, *, chunk_len: int, stages: int):
  """ValueError unless the kernels can take these padded arrays (see `unsupported_reason`)."""
  _, _, query_rows, heads, head_dim = queries.shape
  padded_chunk_len, kv_heads = keys.shape[2:4]
  reason = unsupported_reason(
    head_dim=head_dim,
    chunk_len=chunk_len,
    query_rows=query_rows,
    heads=heads,
    kv_heads=kv_heads,
    dtype=queries.dtype,
    stages=stages,
  )
  if reason:
    raise ValueError(reason)
  if padded_chunk_len != CHUNK_TILE or keys.shape != values.shape or keys.dtype != queries.dtype:
    raise ValueError(
      f"keys and values must be [batch, memory_chunks, {CHUNK_TILE}, kv_heads, head_dim] in queries' "
      f"dtype {queries.dtype}, got {keys.shape} {keys.dtype} and {values.shape} {values.dtype}"
    )


def pad_inputs(q, chunk_k, chunk_v, chunk_weights, chunk_indices, *, stages: int) -> padding.PaddedInputs:
  """Checks the GCA entry point's inputs and pads them for the kernels: each query chunk to a
  multiple of 64 rows (zero rows), each memory chunk to 64 keys (zero keys, masked out).

  Raises:
    ValueError: sizes or a dtype the kernels do not take (naming the argument).
  """
  _, seq, heads, head_dim = q.shape
  chunk_len, kv_heads = chunk_k.shape[2:4]
  query_chunks = chunk_indices.shape[1]
  if chunk_k.dtype != q.dtype or chunk_v.shape != chunk_k.shape or chunk_v.dtype != q.dtype:
    raise ValueError(
      f"chunk_k and chunk_v must have one shape and q's dtype {q.dtype}; got {chunk_k.shape} "
      f"{chunk_k.dtype} and {chunk_v.shape} {chunk_v.dtype}"
    )
  if seq % query_chunks:
    raise ValueError(
      f"q's seq ({seq}) must be query_chunks ({query_chunks}, axis 1 of chunk_indices) times the query chunk length"
    )
  query_len = seq // query_chunks
  query_rows = -(-query_len // TILE_ROWS) * TILE_ROWS
  reason = unsupported_reason(
    head_dim=head_dim,
    chunk_len=chunk_len,
    query_rows=query_rows,
    heads=heads,
    kv_heads=kv_heads,
    dtype=q.dtype,
    stages=stages,
  )
  if reason:
    raise ValueError(reason)
  return padding.pad(q, chunk_k, chunk_v, chunk_weights, chunk_indices, query_rows=query_rows, chunk_tile=CHUNK_TILE)


@dataclasses.dataclass(frozen=True)
class Program:
  """The program's coordinates: batch, head, kv head, query chunk, and its rows in the chunk."""

  batch: jax.Array
  head: jax.Array
  kv_head: jax.Array
  chunk: jax.Array
  rows: pl.Slice

  @classmethod
  def current(cls, *, heads: int, group: int, tiles_per_chunk: int) -> "Program":
    batch_head = lax.axis_index("batch_head")
    query_tile = lax.axis_index("query_tile")
    head = lax.rem(batch_head, heads)
    return cls(
      batch=lax.div(batch_head, heads),
      head=head,
      kv_head=lax.div(head, group),
      chunk=lax.div(query_tile, tiles_per_chunk),
      rows=pl.ds(lax.rem(query_tile, tiles_per_chunk) * TILE_ROWS, TILE_ROWS),
    )

  def query_rows(self, ref):
    """This program's [64, head_dim] tile of a [batch, query_chunks, query_rows, heads, head_dim] ref."""
    return ref.at[self.batch, self.chunk, self.rows, self.head]

  def slot_rows(self, ref):
    """This program's [k, 64] block of a [batch, query_chunks, heads, k, query_rows] ref."""
    return ref.at[self.batch, self.chunk, self.head, :, self.rows]


class KeyValueRing:
  """The retrieved chunks' K and V tiles through `stages` shared-memory buffers each.

  `start()` issues the first `stages` slots' copies; `keys(slot)` / `values(slot)` wait for
  a slot's tile and return its buffer; `release(slot)` (once both of the slot's products
  are done) refills the slot's buffers with slot + stages. Every slot's index is read at
  construction, so the global-memory latencies overlap and no copy waits on one.
  """

  def __init__(self, program: Program, indices_ref, keys_ref, values_ref, buffers, *, top_k: int, stages: int):
    self.program, self.keys_ref, self.values_ref = program, keys_ref, values_ref
    self.key_buffers, self.value_buffers, self.key_barriers, self.value_barriers = buffers
    self.top_k, self.stages = top_k, stages
    self.indices = [indices_ref[program.batch, program.chunk, slot] for slot in range(top_k)]

  def _load(self, slot: int):
    stage = slot % self.stages
    source = (self.program.batch, self.indices[slot], slice(None), self.program.kv_head)
    plgpu.copy_gmem_to_smem(self.keys_ref.at[source], self.key_buffers[stage], self.key_barriers.at[stage])
    plgpu.copy_gmem_to_smem(self.values_ref.at[source], self.value_buffers[stage], self.value_barriers.at[stage])

  def start(self):
    for slot in range(min(self.stages, self.top_k)):
      self._load(slot)

  def keys(self, slot: int):
    plgpu.barrier_wait(self.key_barriers.at[slot % self.stages])
    return self.key_buffers[slot % self.stages]

  def values(self, slot: int):
    plgpu.barrier_wait(self.value_barriers.at[slot % self.stages])
    return self.value_buffers[slot % self.stages]

  def release(self, slot: int):
    if slot + self.stages < self.top_k:
      self._load(slot + self.stages)


def query_tile_program(
  indices_ref,
  weights_ref,
  keys_ref,
  values_ref,
  ring_buffers,
  *,
  heads: int,
  group: int,
  tiles_per_chunk: int,
  top_k: int,
  stages: int,
):
  """(program, ring, weights) of a query-tile kernel (the forward, the query-side backward):
  its coordinates, the ring that gathers its k retrieved K/V tiles, and the k chunk weights
  as scalars."""
  program = Program.current(heads=heads, group=group, tiles_per_chunk=tiles_per_chunk)
  ring = KeyValueRing(program, indices_ref, keys_ref, values_ref, ring_buffers, top_k=top_k, stages=stages)
  weights = [weights_ref[program.batch, program.chunk, slot] for slot in range(top_k)]
  return program, ring, weights


def ring_scratch(stages: int, head_dim: int, dtype):
  """Shared memory and barriers of a `KeyValueRing`: (key buffers, value buffers, key
  barriers, value barriers). The buffers are separate refs, not one [stages, ...] buffer: a
  static index into one buffer does not lower inside a preinitialized accumulator's scope."""
  buffers = lambda: tuple(operand_smem((CHUNK_TILE, head_dim), dtype) for _ in range(stages))
  return (
    buffers(),
    buffers(),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages),
    plgpu.Barrier(num_arrivals=1, num_barriers=stages),
  )


def ring_bytes(stages: int, head_dim: int, dtype) -> int:
  return 2 * stages * CHUNK_TILE * head_dim * jnp.dtype(dtype).itemsize


def key_mask(chunk_len: int, *, keys_axis: int = 1):
  """bool [64, 64] in the WGMMA layout: the score tile's real (unpadded) keys, which lie
  along `keys_axis` (1: S = Q K^T, the query-side kernels; 0: S^T = K Q^T, the memory side)."""
  positions = plgpu.broadcasted_iota(jnp.int32, (TILE_ROWS, CHUNK_TILE), keys_axis, layout=plgpu.Layout.WGMMA)
  return positions < chunk_len


def products_together(pairs, *, shape=None, inits=None, in_place: bool = True):
  """[inits[i] +] pairs[i][0] @ pairs[i][1] for every pair, float32 accumulation, the wgmmas
  issued back to back and waited on once.

  Without `inits` each product gets a fresh [shape] accumulator. With `inits` and `in_place`
  the accumulators start from them (no second register tile); GPU interpret mode cannot run
  a preinitialized accumulator, so there (`in_place=False`) the products are added after.
  """

  def issue(accumulators):
    for accumulator, (a, b) in zip(accumulators, pairs):
      plgpu.wgmma(accumulator, a, b)

  if inits is not None and in_place:
    return list(pl.run_state(issue)(tuple(plgpu.ACC.init(init) for init in inits)))
  shapes = [init.shape for init in inits] if inits is not None else [shape] * len(pairs)

  def fresh(*accumulators):
    issue(accumulators)
    return tuple(accumulator[...] for accumulator in accumulators)

  results = pl.run_scoped(fresh, *(plgpu.ACC(s, jnp.float32) for s in shapes))
  return list(results) if inits is None else [init + result for init, result in zip(inits, results)]


def launch_grid(kernel, out_type, scratch, *, grid, grid_names, interpret):
  """plgpu.kernel, one warpgroup per program, over `grid` (its last axis launches fastest)."""
  return plgpu.kernel(
    kernel,
    out_type=out_type,
    scratch_types=scratch,
    grid=grid,
    grid_names=grid_names,
    compiler_params=compiler_params(),
    interpret=interpret,
  )


def launch(kernel, out_type, scratch, *, batch: int, heads: int, query_chunks: int, query_rows: int, interpret):
  """`launch_grid` over (batch * heads, query tiles); the last axis launches fastest, so the
  programs in flight share one (batch, head)'s memory in L2."""
  return launch_grid(
    kernel,
    out_type,
    scratch,
    grid=(batch * heads, query_chunks * (query_rows // TILE_ROWS)),
    grid_names=("batch_head", "query_tile"),
    interpret=interpret,
  )
