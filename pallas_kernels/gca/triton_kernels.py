"""GCA forward and backward Pallas (Triton) kernels.

Layouts (prepared by `ops`): queries, outputs and their gradients
[batch, query_chunks, padded_query_len, heads, head_dim] (zero rows pad each query
chunk to its query blocks: full blocks of `block_q` rows, then one smaller power-of-two
block for the rest, so 65 rows run as 64 + 16, not 128); memory keys and values
[batch, memory_chunks, padded_chunk_len, kv_heads, head_dim] (zero keys pad each chunk
to a power of two, masked out of every softmax); chunk indices int32 and weights float32
[batch, query_chunks, k]; per-slot log-normalizers and deltas float32
[batch, query_chunks, k, padded_query_len, heads].

Every program keeps one whole memory chunk as a single key tile (at most 256 keys), so
the softmax_1 over a retrieved chunk needs no online rescaling: with m = max(0, row max)
(the implicit zero logit is part of the maximum), l = exp(-m) + sum_s exp(s - m), and
the slot's normalized output is (sum_s exp(s - m) v_s) / l. Scores are kept in base 2
(scale * log2(e) folded into one multiply, exp2 on the GPU's fast path); the stored
log-normalizer is log2(l) + m in those units.

Three kernels:
  forward          (batch, query chunk, head block, query block), one launch per block
                   size (the full blocks, then the remainder's): loops over the k slots,
                   gathers each slot's K/V tile by its index from the whole memory (no
                   gathered copy), accumulates sum_j w_j O'_j in registers, writes O and
                   the per-slot log-normalizers.
  backward_queries same grid: per slot recomputes P, dP = dO V^T and
                   r = rowsum(P * dP) = rowsum(dO * O'_j) (so O'_j is never recomputed),
                   dS = w_j P (dP - r), accumulates dQ = scale * sum_j dS_j K_j, and writes
                   dw partials (sum of r over its rows) and delta_j = w_j r for the
                   memory side.
  backward_memory  (batch, memory chunk, kv head): walks the list of (query chunk, slot)
                   pairs that retrieved its chunk (sorted by `ops`), recomputes P and dS
                   for each of their query rows and heads, and accumulates dK and dV in
                   registers; each memory chunk's gradient is written once by one program.
                   That is the scatter-add of the gather's VJP done deterministically,
                   with neither atomics nor a [query_chunks, k, chunk_len, d] buffer of
                   per-pair partials.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from pallas_kernels.config_checks import next_power_of_two
from pallas_kernels.gca.config import GcaTritonConfig

LOG2_E = math.log2(math.e)
_SMALLEST_BLOCK = 16  # rows: the smallest tile side of the GPU's matrix units


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static sizes of one call (hashable: part of the kernels' static arguments).

  Attributes:
    query_len: real rows per query chunk.
    block_q: query rows per program of the full blocks (a power of two >= 16).
    heads_per_program: query heads stacked into the tile, P (a power of two dividing group).
    group: query heads per kv head.
    chunk_len: real keys per memory chunk (the padded tile is `padded_chunk_len`).
    padded_chunk_len: keys per tile, a power of two >= 16.
  """

  query_len: int
  block_q: int
  heads_per_program: int
  group: int
  chunk_len: int
  padded_chunk_len: int

  @property
  def segments(self) -> tuple[tuple[int, int, int], ...]:
    """(first row, block rows, blocks) of the runs of equal query blocks that cover a query
    chunk: the full blocks, then one power-of-two block (>= 16 rows) for the rest. Every
    run starts at a multiple of its block."""
    full = self.query_len // self.block_q
    rest = self.query_len - full * self.block_q
    runs = [(0, self.block_q, full)] if full else []
    if rest:
      runs.append((full * self.block_q, max(_SMALLEST_BLOCK, next_power_of_two(rest)), 1))
    return tuple(runs)

  @property
  def padded_query_len(self) -> int:
    first, block, blocks = self.segments[-1]
    return first + block * blocks

  @property
  def row_blocks(self) -> tuple[tuple[int, int], ...]:
    """(first row, rows) of every query block of a query chunk."""
    return tuple((first + i * block, block) for first, block, blocks in self.segments for i in range(blocks))


class _Tiles:
  """Loads, products and softmax_1 pieces shared by the three kernels."""

  def __init__(self, tiling: Tiling, block_q: int, operand_dtype, scale: float):
    self.tiling = tiling
    self.block_q = block_q
    self.rows = block_q * tiling.heads_per_program
    self.operand_dtype = operand_dtype
    # float32 operands: full-precision products (no TF32), to match the references.
    self.precision = lax.Precision.HIGHEST if operand_dtype == jnp.float32 else None
    self.scale = scale
    self.key_valid = jnp.arange(tiling.padded_chunk_len) < tiling.chunk_len

  def dot(self, a, b, trans_a=False, trans_b=False):
    """a @ b in float32 from operands cast to the operand dtype."""
    return pltriton.dot(
      a.astype(self.operand_dtype),
      b.astype(self.operand_dtype),
      trans_a=trans_a,
      trans_b=trans_b,
      precision=self.precision,
    )

  def as_rows(self, x):
    """[block_q, P, ...] (or [block_q, ...] when P = 1) -> [block_q * P, ...], row-major."""
    if self.tiling.heads_per_program == 1:
      return x
    return x.reshape(self.rows, *x.shape[2:])

  def from_rows(self, x):
    """The inverse of `as_rows`."""
    if self.tiling.heads_per_program == 1:
      return x
    return x.reshape(self.block_q, self.tiling.heads_per_program, *x.shape[1:])

  def scores(self, queries, keys):
    """Base-2 scores [rows, padded_chunk_len], -inf at padded keys."""
    scores = self.dot(queries, keys, trans_b=True) * (self.scale * LOG2_E)
    return jnp.where(self.key_valid[None, :], scores, -jnp.inf)

  def probabilities(self, queries, keys, log_normalizer):
    """softmax_1 of the slot, [rows, padded_chunk_len], from its stored log-normalizer."""
    return jnp.exp2(self.scores(queries, keys) - log_normalizer[:, None])


def _row_block(tiling: Tiling, first_row: int, block_q: int, head_dim: int):
  """Block of a [batch, query_chunks, padded_query_len, heads, head_dim] array for program
  (b, c, head block, query block) of the run of `block_q`-row blocks from `first_row`:
  [block_q, (P,) head_dim]."""
  heads = None if tiling.heads_per_program == 1 else tiling.heads_per_program
  first = first_row // block_q
  return pl.BlockSpec((None, None, block_q, heads, head_dim), lambda b, c, hb, qb: (b, c, first + qb, hb, 0))


def _slot_rows_block(tiling: Tiling, first_row: int, block_q: int, top_k: int):
  """The same for a [batch, query_chunks, k, padded_query_len, heads] array: [k, block_q, (P)]."""
  heads = None if tiling.heads_per_program == 1 else tiling.heads_per_program
  first = first_row // block_q
  return pl.BlockSpec((None, None, top_k, block_q, heads), lambda b, c, hb, qb: (b, c, 0, first + qb, hb))


def _slot_block(top_k: int):
  """Block of a [batch, query_chunks, k] array: the program's query chunk's k slots."""
  return pl.BlockSpec((None, None, top_k), lambda b, c, hb, qb: (b, c, 0))


def _memory_block(tiling: Tiling, memory_chunks: int, head_dim: int):
  """Block of the memory [batch, memory_chunks, padded_chunk_len, kv_heads, head_dim]: every chunk
  of the program's kv head, [memory_chunks, padded_chunk_len, head_dim]."""
  blocks_per_kv_head = tiling.group // tiling.heads_per_program
  return pl.BlockSpec(
    (None, memory_chunks, tiling.padded_chunk_len, None, head_dim),
    lambda b, c, hb, qb: (b, 0, 0, hb // blocks_per_kv_head, 0),
  )


def _query_grid(queries, tiling: Tiling, blocks: int):
  batch, query_chunks, _, heads, _ = queries.shape
  return (batch, query_chunks, heads // tiling.heads_per_program, blocks)


def _compiler_params(num_warps: int, num_stages: int):
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _per_segment(tiling: Tiling, launch, num_aliased: int):
  """Runs launch(first_row, block_q, blocks, previous) once per run of query blocks; each
  launch after the first writes its rows into the first `num_aliased` outputs of the one
  before (`previous`, aliased: no copy). Returns the last launch's aliased outputs and a
  list of every launch's other outputs."""
  previous, others = None, []
  for first_row, block_q, blocks in tiling.segments:
    outputs = launch(first_row, block_q, blocks, previous)
    previous = tuple(outputs[:num_aliased])
    others.append(tuple(outputs[num_aliased:]))
  return previous, others


def _skipping_aliased_inputs(kernel, num_inputs: int, num_aliased: int):
  """kernel(*inputs, *outputs) called as pallas_call calls it with `num_aliased` aliased
  buffers after the inputs (whose contents the kernel never reads)."""

  def body(*refs):
    return kernel(*refs[:num_inputs], *refs[num_inputs + num_aliased :])

  return body


def _aliased_call(kernel, inputs, previous, **call):
  """pallas_call(kernel, **call)(*inputs), writing into `previous` (buffers for its first
  outputs, aliased) when given."""
  num_inputs = len(inputs)
  aliases = {}
  if previous is not None:
    kernel = _skipping_aliased_inputs(kernel, num_inputs, len(previous))
    aliases = {num_inputs + i: i for i in range(len(previous))}
    call["in_specs"] = list(call["in_specs"]) + list(call["out_specs"][: len(previous)])
    inputs = tuple(inputs) + tuple(previous)
  return pl.pallas_call(kernel, input_output_aliases=aliases, **call)(*inputs)


# ---------------------------------------------------------------------------
# Forward


def _forward_kernel(
  indices_ref,
  weights_ref,
  queries_ref,
  keys_ref,
  values_ref,
  out_ref,
  lse_ref,
  *,
  tiling: Tiling,
  block_q: int,
  top_k: int,
  scale: float,
):
  tiles = _Tiles(tiling, block_q, queries_ref.dtype, scale)
  queries = tiles.as_rows(queries_ref[...])

  def slot(j, out):
    index = indices_ref[j]
    keys, values = keys_ref[index], values_ref[index]
    scores = tiles.scores(queries, keys)
    # softmax_1: the implicit zero logit enters the maximum and adds exp2(-m) to the sum.
    top = jnp.maximum(jnp.max(scores, axis=1), 0.0)
    probs = jnp.exp2(scores - top[:, None])
    total = jnp.exp2(-top) + jnp.sum(probs, axis=1)
    lse_ref[j] = tiles.from_rows(top + jnp.log2(total))
    return out + tiles.dot(probs, values) * (weights_ref[j] / total)[:, None]

  out = lax.fori_loop(0, top_k, slot, jnp.zeros((tiles.rows, queries.shape[-1]), jnp.float32))
  out_ref[...] = tiles.from_rows(out).astype(out_ref.dtype)


def forward(
  queries, keys, values, weights, indices, *, tiling: Tiling, scale: float, config: GcaTritonConfig, interpret: bool
):
  """O = sum_j w_j softmax_1(Q K_j^T scale) V_j and the per-slot log-normalizers.

  Args:
    queries: [batch, query_chunks, tiling.padded_query_len, heads, head_dim].
    keys, values: [batch, memory_chunks, padded_chunk_len, kv_heads, head_dim].
    weights: float32 [batch, query_chunks, k]; indices: int32 [batch, query_chunks, k],
      in range.

  Returns:
    out: like queries; lse: float32 [batch, query_chunks, k, padded_query_len, heads], the
    base-2 log of each slot's softmax_1 denominator (in base-2 score units).
  """
  batch, query_chunks, padded_query_len, heads, head_dim = queries.shape
  top_k = indices.shape[-1]
  memory = _memory_block(tiling, keys.shape[1], head_dim)

  def launch(first_row, block_q, blocks, previous):
    return _aliased_call(
      functools.partial(_forward_kernel, tiling=tiling, block_q=block_q, top_k=top_k, scale=scale),
      (indices, weights, queries, keys, values),
      previous,
      grid=_query_grid(queries, tiling, blocks),
      in_specs=[
        _slot_block(top_k),
        _slot_block(top_k),
        _row_block(tiling, first_row, block_q, head_dim),
        memory,
        memory,
      ],
      out_specs=[_row_block(tiling, first_row, block_q, head_dim), _slot_rows_block(tiling, first_row, block_q, top_k)],
      out_shape=[
        jax.ShapeDtypeStruct(queries.shape, queries.dtype),
        jax.ShapeDtypeStruct((batch, query_chunks, top_k, padded_query_len, heads), jnp.float32),
      ],
      compiler_params=_compiler_params(config.num_warps, config.num_stages),
      interpret=interpret,
      name="gca_forward",
    )

  (out, lse), _ = _per_segment(tiling, launch, num_aliased=2)
  return out, lse


# ---------------------------------------------------------------------------
# Backward, query side: dQ, dw and the deltas


def _backward_queries_kernel(
  indices_ref,
  weights_ref,
  queries_ref,
  d_out_ref,
  lse_ref,
  keys_ref,
  values_ref,
  d_queries_ref,
  delta_ref,
  d_weights_ref,
  *,
  tiling: Tiling,
  block_q: int,
  top_k: int,
  scale: float,
):
  tiles = _Tiles(tiling, block_q, queries_ref.dtype, scale)
  queries = tiles.as_rows(queries_ref[...])
  d_out = tiles.as_rows(d_out_ref[...])

  def slot(j, d_queries):
    index, weight = indices_ref[j], weights_ref[j]
    keys, values = keys_ref[index], values_ref[index]
    probs = tiles.probabilities(queries, keys, tiles.as_rows(lse_ref[j]))
    d_probs = tiles.dot(d_out, values, trans_b=True)  # dO V^T: dP of O'_j before the weight
    row_dot = jnp.sum(probs * d_probs, axis=1)  # rowsum(dO * O'_j)
    d_weights_ref[j] = jnp.sum(row_dot)
    delta_ref[j] = tiles.from_rows(weight * row_dot)
    d_scores = probs * (d_probs - row_dot[:, None]) * weight
    return d_queries + tiles.dot(d_scores, keys)

  d_queries = lax.fori_loop(0, top_k, slot, jnp.zeros((tiles.rows, queries.shape[-1]), jnp.float32))
  d_queries_ref[...] = tiles.from_rows(d_queries * scale).astype(d_queries_ref.dtype)


def backward_queries(
  queries,
  keys,
  values,
  weights,
  indices,
  lse,
  d_out,
  *,
  tiling: Tiling,
  scale: float,
  config: GcaTritonConfig,
  interpret: bool,
):
  """dQ, the deltas w_j rowsum(dO * O'_j) and the chunk weights' gradient.

  Args:
    queries, keys, values, weights, indices, lse: as `forward` takes and returns them.
    d_out: like queries, the output's cotangent (zero in padded rows).

  Returns:
    d_queries: like queries; delta: float32 like lse; d_weights: float32 [batch, query_chunks, k].
  """
  top_k = indices.shape[-1]
  head_dim = queries.shape[-1]
  memory = _memory_block(tiling, keys.shape[1], head_dim)

  def launch(first_row, block_q, blocks, previous):
    grid = _query_grid(queries, tiling, blocks)
    rows = _row_block(tiling, first_row, block_q, head_dim)
    slot_rows = _slot_rows_block(tiling, first_row, block_q, top_k)
    return _aliased_call(
      functools.partial(_backward_queries_kernel, tiling=tiling, block_q=block_q, top_k=top_k, scale=scale),
      (indices, weights, queries, d_out, lse, keys, values),
      previous,
      grid=grid,
      in_specs=[_slot_block(top_k), _slot_block(top_k), rows, rows, slot_rows, memory, memory],
      out_specs=[
        rows,
        slot_rows,
        pl.BlockSpec((None, None, None, None, top_k), lambda b, c, hb, qb: (b, c, hb, qb, 0)),
      ],
      out_shape=[
        jax.ShapeDtypeStruct(queries.shape, queries.dtype),
        jax.ShapeDtypeStruct(lse.shape, jnp.float32),
        jax.ShapeDtypeStruct((*grid, top_k), jnp.float32),
      ],
      compiler_params=_compiler_params(config.bwd_num_warps, config.bwd_num_stages),
      interpret=interpret,
      name="gca_backward_queries",
    )

  (d_queries, delta), per_program_d_weights = _per_segment(tiling, launch, num_aliased=2)
  d_weights = sum(jnp.sum(parts, axis=(2, 3)) for (parts,) in per_program_d_weights)
  return d_queries, delta, d_weights


# ---------------------------------------------------------------------------
# Backward, memory side: dK and dV, one program per memory chunk and kv head


def _backward_memory_kernel(
  order_ref,
  starts_ref,
  weights_ref,
  queries_ref,
  d_out_ref,
  lse_ref,
  delta_ref,
  keys_ref,
  values_ref,
  d_keys_ref,
  d_values_ref,
  *,
  tiling: Tiling,
  top_k: int,
  scale: float,
):
  chunk = pl.program_id(1)
  keys, values = keys_ref[...], values_ref[...]
  per_program = tiling.heads_per_program
  head_blocks = tiling.group // per_program

  def pair(e, carry):
    d_keys, d_values = carry
    flat = order_ref[e]  # one (query chunk, slot) that retrieved this chunk
    query_chunk, j = flat // top_k, flat % top_k
    weight = weights_ref[query_chunk, j]
    for first_row, block_q in tiling.row_blocks:
      tiles = _Tiles(tiling, block_q, queries_ref.dtype, scale)
      rows = pl.ds(first_row, block_q)
      for head_block in range(head_blocks):
        heads = head_block if per_program == 1 else pl.ds(head_block * per_program, per_program)
        queries = tiles.as_rows(queries_ref[query_chunk, rows, heads, :])
        d_out = tiles.as_rows(d_out_ref[query_chunk, rows, heads, :])
        probs = tiles.probabilities(queries, keys, tiles.as_rows(lse_ref[query_chunk, j, rows, heads]))
        delta = tiles.as_rows(delta_ref[query_chunk, j, rows, heads])
        d_scores = probs * (tiles.dot(d_out, values, trans_b=True) * weight - delta[:, None])
        d_values = d_values + tiles.dot(probs, d_out, trans_a=True) * weight
        d_keys = d_keys + tiles.dot(d_scores, queries, trans_a=True)
    return d_keys, d_values

  zeros = jnp.zeros(keys.shape, jnp.float32)
  d_keys, d_values = lax.fori_loop(starts_ref[chunk], starts_ref[chunk + 1], pair, (zeros, zeros))
  d_keys_ref[...] = (d_keys * scale).astype(d_keys_ref.dtype)
  d_values_ref[...] = d_values.astype(d_values_ref.dtype)


def backward_memory(
  queries,
  keys,
  values,
  weights,
  lse,
  delta,
  d_out,
  order,
  starts,
  *,
  tiling: Tiling,
  scale: float,
  config: GcaTritonConfig,
  interpret: bool,
):
  """dK and dV of every memory chunk, summed over every (query chunk, slot) that retrieved it.

  Args:
    queries, keys, values, weights, lse, d_out: as `backward_queries`; delta: its output.
    order: int32 [batch, query_chunks * k], the flat (query chunk * k + slot) pairs sorted by
      the memory chunk they retrieved (pairs of weight 0, whose gradients vanish, last and
      outside every chunk's range).
    starts: int32 [batch, memory_chunks + 1]: chunk m's pairs are order[starts[m]:starts[m+1]].

  Returns:
    d_keys, d_values: like keys and values.
  """
  batch, query_chunks, padded_query_len, heads, head_dim = queries.shape
  memory_chunks, kv_heads = keys.shape[1], keys.shape[3]
  top_k = weights.shape[-1]
  group = tiling.group
  whole_rows = pl.BlockSpec((None, query_chunks, padded_query_len, group, head_dim), lambda b, m, h: (b, 0, 0, h, 0))
  whole_slots = pl.BlockSpec((None, query_chunks, top_k, padded_query_len, group), lambda b, m, h: (b, 0, 0, 0, h))
  chunk_tile = pl.BlockSpec((None, None, tiling.padded_chunk_len, None, head_dim), lambda b, m, h: (b, m, 0, h, 0))
  return pl.pallas_call(
    functools.partial(_backward_memory_kernel, tiling=tiling, top_k=top_k, scale=scale),
    grid=(batch, memory_chunks, kv_heads),
    in_specs=[
      pl.BlockSpec((None, query_chunks * top_k), lambda b, m, h: (b, 0)),
      pl.BlockSpec((None, memory_chunks + 1), lambda b, m, h: (b, 0)),
      pl.BlockSpec((None, query_chunks, top_k), lambda b, m, h: (b, 0, 0)),
      whole_rows,
      whole_rows,
      whole_slots,
      whole_slots,
      chunk_tile,
      chunk_tile,
    ],
    out_specs=[chunk_tile, chunk_tile],
    out_shape=[jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct(values.shape, values.dtype)],
    compiler_params=_compiler_params(config.memory_num_warps, config.memory_num_stages),
    interpret=interpret,
    name="gca_backward_memory",
  )(order, starts, weights, queries, d_out, lse, delta, keys, values)
