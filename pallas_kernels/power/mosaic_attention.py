"""Power attention's in-chunk attention as Pallas Mosaic GPU (Hopper: wgmma + TMA) kernels, forward
and backward.

The math is the Triton kernels' (`triton_kernels.query_state_attention`, `attention_backward`).
Within each chunk, with q already scaled, G the cumulative log-gate and causal i >= j:

  s_ij = q_i . k_j,   decay_ij = e^{G_i - G_j},   A_ij = s_ij^2 decay_ij
  y_i = (N_i + sum_j A_ij v_j) / (den_i + sum_j A_ij)   (N, den: the states' part, or 0)
  dA_ij = dN_i . v_j + dden_i,   dS_ij = 2 s_ij decay_ij dA_ij
  dq_i = sum_j dS_ij k_j,   dk_j = sum_i dS_ij q_i,   dv_j = sum_i A_ij dN_i
  dG_i (query side) = sum_j A_ij dA_ij,   dG_j (key side) = -sum_i A_ij dA_ij

Three kernels, one warpgroup per program, each streaming the other side's 64-row tiles through
a `stages`-deep ring of shared-memory buffers with TMA (the GCA Mosaic kernels' schedule):

- forward: one program per (batch * head, 64-row query tile) walks the key tiles of its chunk
  up to its own (the diagonal tile masked): S = Q K^T, then the numerator += A V with A from
  registers, starting from the states' part, and normalizes at the end;
- queries: the same walk for the backward: S = Q K^T and dP = dN V^T issued together, then
  dQ += dS K with dS from registers;
- keys: one program per (batch * kv head, 64-row key tile) walks, for each query head of the
  kv head, the query tiles from its own to the chunk's end, in the transposed frame (keys as
  rows, so that dK and dV are wgmma accumulators): S^T = K Q^T and dP^T = V dN^T together,
  then dV += A^T dN and dK += dS^T Q together.

Each gradient is written once, by one program: no atomics. GPU interpret mode (CPU) stages
the register operands through shared memory and adds the products after the wgmma
(`pallas_kernels.mosaic_common`); the H100 lowering test covers the GPU variant.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.gca.mosaic_tiles import launch_grid, products_together
from pallas_kernels.mosaic_common import operand_smem, register_operand, wgmma_zeros
from pallas_kernels.mosaic_kernel_cache import share_identical_kernels
from pallas_kernels.power import mosaic_tiles
from pallas_kernels.power.mosaic_tiles import DEFAULT_STAGES, TILE, Ring, check_inputs, kv_head, store_tiles

KERNELS = "the Mosaic in-chunk attention kernels"

# Why the kernels cannot take given sizes (naming the argument and the fix), or None.
unsupported_reason = functools.partial(mosaic_tiles.unsupported_reason, KERNELS)


class _QueryTile:
  """A query-tile program's coordinates (the forward's and the queries-side backward's) and the
  ring of its chunk's key tiles up to its own: K, V and their log-gates."""

  def __init__(
    self, k_ref, v_ref, g_ref, buffers, barriers, *, heads: int, group: int, tiles_per_chunk: int, stages: int
  ):
    self.batch_head = lax.axis_index("batch_head")
    self.tile = lax.axis_index("query_tile")
    self.batch_kv_head = kv_head(self.batch_head, heads=heads, group=group)
    self.rows = pl.ds(self.tile * TILE, TILE)
    self.first_key_tile = lax.div(self.tile, tiles_per_chunk) * tiles_per_chunk
    self.num_steps = self.tile - self.first_key_tile + 1
    keys = lambda step: pl.ds(self.key_start(step), TILE)
    self.ring = Ring(
      lambda step: tuple(ref.at[self.batch_kv_head, keys(step)] for ref in (k_ref, v_ref, g_ref)),
      buffers,
      barriers,
      num_steps=self.num_steps,
      stages=stages,
    )

  def key_start(self, step):
    return (self.first_key_tile + step) * TILE


def _decay(g_rows, g_cols, row_start, col_start, *, queries_on_rows: bool):
  """e^{G_query - G_key} where the query is at or after the key, else 0; float32 [64, 64] in the
  WGMMA layout. `g_rows` / `g_cols`: the rows' and columns' log-gates, already broadcast."""
  rows = row_start + plgpu.broadcasted_iota(jnp.int32, (TILE, TILE), 0, layout=plgpu.Layout.WGMMA)
  cols = col_start + plgpu.broadcasted_iota(jnp.int32, (TILE, TILE), 1, layout=plgpu.Layout.WGMMA)
  causal = rows >= cols if queries_on_rows else cols >= rows
  exponent = g_rows - g_cols if queries_on_rows else g_cols - g_rows
  # Past the causal edge the exponent can be positive and overflow: select before exponentiating.
  return jnp.where(causal, jnp.exp(jnp.where(causal, exponent, 0.0)), 0.0)


def _broadcast(vector, axis: int):
  """A [64] vector as a [64, 64] tile, constant along `axis`."""
  return lax.broadcast_in_dim(vector, (TILE, TILE), [1 - axis])


def _forward_kernel(
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  *refs,
  program_options: dict,
  with_state: bool,
  interpreted: bool,
):
  """One program: the normalized outputs and denominators of one 64-row query tile of one (batch, head)."""
  if with_state:
    state_numerator_ref, state_denominator_ref, *refs = refs
  (out_ref, denominator_ref, query_smem, vectors_smem, numerator_smem, out_smem, key_ring, value_ring, g_ring) = refs[
    :9
  ]
  weights_staging, input_barrier, step_barriers = refs[9:]
  program = _QueryTile(k_ref, v_ref, g_ref, (key_ring, value_ring, g_ring), step_barriers, **program_options)
  batch_head, batch_kv_head, rows = program.batch_head, program.batch_kv_head, program.rows
  dtype = query_smem.dtype
  g_smem, denominator_smem = vectors_smem

  plgpu.copy_gmem_to_smem(q_ref.at[batch_head, rows], query_smem, input_barrier)
  plgpu.copy_gmem_to_smem(g_ref.at[batch_kv_head, rows], g_smem, input_barrier)
  if with_state:
    plgpu.copy_gmem_to_smem(state_numerator_ref.at[batch_head, rows], numerator_smem, input_barrier)
    plgpu.copy_gmem_to_smem(state_denominator_ref.at[batch_head, rows], denominator_smem, input_barrier)
  program.ring.start()
  plgpu.barrier_wait(input_barrier)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  column_layout = plgpu.Layout.WGMMA.reduce(0)
  g_queries = _broadcast(plgpu.load(g_smem, layout=row_layout), 1)
  value_dim = value_ring.shape[-1]
  if with_state:
    numerator = plgpu.load(numerator_smem, layout=plgpu.Layout.WGMMA)
    denominator = plgpu.load(denominator_smem, layout=row_layout)
  else:
    numerator = wgmma_zeros((TILE, value_dim))
    denominator = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout)

  def step_body(step, carry):
    numerator, denominator = carry
    stage = program.ring.wait(step)
    keys, values = key_ring.at[stage], value_ring.at[stage]
    (scores,) = products_together([(query_smem, keys.T)], shape=(TILE, TILE))
    g_keys = _broadcast(plgpu.load(g_ring.at[stage], layout=column_layout), 0)
    decay = _decay(g_queries, g_keys, program.tile * TILE, program.key_start(step), queries_on_rows=True)
    weights = scores * scores * decay
    denominator = denominator + jnp.sum(weights, axis=1)
    weights = register_operand(weights.astype(dtype), weights_staging)
    (numerator,) = products_together([(weights, values)], inits=(numerator,), in_place=not interpreted)
    program.ring.refill(step)
    return numerator, denominator

  numerator, denominator = lax.fori_loop(0, program.num_steps, step_body, (numerator, denominator))
  zero = denominator == 0.0
  inverse = jnp.where(zero, 0.0, 1.0 / jnp.where(zero, 1.0, denominator))
  out = (numerator * lax.broadcast_in_dim(inverse, numerator.shape, [0])).astype(out_smem.dtype)
  store_tiles(
    [
      (out, out_smem, out_ref.at[batch_head, rows]),
      (denominator, denominator_smem, denominator_ref.at[batch_head, rows]),
    ]
  )


def _queries_kernel(
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  d_num_ref,
  d_den_ref,
  dq_ref,
  dg_ref,
  query_smem,
  d_num_smem,
  vectors_smem,
  key_ring,
  value_ring,
  g_ring,
  dq_staging,
  d_scores_staging,
  input_barrier,
  step_barriers,
  *,
  program_options: dict,
  interpreted: bool,
):
  """One program: dQ and the query side's dG of one 64-row query tile of one (batch, head)."""
  program = _QueryTile(k_ref, v_ref, g_ref, (key_ring, value_ring, g_ring), step_barriers, **program_options)
  batch_head, batch_kv_head, rows = program.batch_head, program.batch_kv_head, program.rows
  dtype = query_smem.dtype
  g_smem, d_den_smem = vectors_smem

  plgpu.copy_gmem_to_smem(q_ref.at[batch_head, rows], query_smem, input_barrier)
  plgpu.copy_gmem_to_smem(d_num_ref.at[batch_head, rows], d_num_smem, input_barrier)
  plgpu.copy_gmem_to_smem(g_ref.at[batch_kv_head, rows], g_smem, input_barrier)
  plgpu.copy_gmem_to_smem(d_den_ref.at[batch_head, rows], d_den_smem, input_barrier)
  program.ring.start()
  plgpu.barrier_wait(input_barrier)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  column_layout = plgpu.Layout.WGMMA.reduce(0)
  g_queries = _broadcast(plgpu.load(g_smem, layout=row_layout), 1)
  d_den = _broadcast(plgpu.load(d_den_smem, layout=row_layout), 1)

  def step_body(step, carry):
    dq, dg = carry
    stage = program.ring.wait(step)
    keys, values = key_ring.at[stage], value_ring.at[stage]
    scores, d_weights = products_together([(query_smem, keys.T), (d_num_smem, values.T)], shape=(TILE, TILE))
    g_keys = _broadcast(plgpu.load(g_ring.at[stage], layout=column_layout), 0)
    decay = _decay(g_queries, g_keys, program.tile * TILE, program.key_start(step), queries_on_rows=True)
    d_weights = d_weights + d_den
    weights = scores * scores * decay
    dg = dg + jnp.sum(weights * d_weights, axis=1)
    d_scores = register_operand((2.0 * scores * decay * d_weights).astype(dtype), d_scores_staging)
    (dq,) = products_together([(d_scores, keys)], inits=(dq,), in_place=not interpreted)
    program.ring.refill(step)
    return dq, dg

  head_dim = query_smem.shape[-1]
  dg_init = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout)
  dq, dg = lax.fori_loop(0, program.num_steps, step_body, (wgmma_zeros((TILE, head_dim)), dg_init))
  store_tiles([(dq, dq_staging, dq_ref.at[batch_head, rows]), (dg, g_smem, dg_ref.at[batch_head, rows])])


def _keys_kernel(
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  d_num_ref,
  d_den_ref,
  dk_ref,
  dv_ref,
  dg_ref,
  key_smem,
  value_smem,
  g_smem,
  query_ring,
  d_num_ring,
  g_ring,
  d_den_ring,
  dk_staging,
  dv_staging,
  operand_staging,
  input_barrier,
  step_barriers,
  *,
  group: int,
  tiles_per_chunk: int,
  stages: int,
  interpreted: bool,
):
  """One program: dK, dV and the key side's dG of one 64-row key tile of one (batch, kv head)."""
  batch_kv_head = lax.axis_index("batch_kv_head")
  key_tile = lax.axis_index("key_tile")
  rows = pl.ds(key_tile * TILE, TILE)
  last_query_tile = (lax.div(key_tile, tiles_per_chunk) + 1) * tiles_per_chunk
  query_tiles = last_query_tile - key_tile
  num_steps = group * query_tiles
  dtype = key_smem.dtype

  plgpu.copy_gmem_to_smem(k_ref.at[batch_kv_head, rows], key_smem, input_barrier)
  plgpu.copy_gmem_to_smem(v_ref.at[batch_kv_head, rows], value_smem, input_barrier)
  plgpu.copy_gmem_to_smem(g_ref.at[batch_kv_head, rows], g_smem, input_barrier)

  def step_tile(step):
    """(batch * head, first query row) of a step: head-major, then query tiles."""
    head = batch_kv_head * group + lax.div(step, query_tiles)
    return head, (key_tile + lax.rem(step, query_tiles)) * TILE

  def sources(step):
    head, start = step_tile(step)
    queries = pl.ds(start, TILE)
    return (
      q_ref.at[head, queries],
      d_num_ref.at[head, queries],
      g_ref.at[batch_kv_head, queries],
      d_den_ref.at[head, queries],
    )

  ring = Ring(sources, (query_ring, d_num_ring, g_ring, d_den_ring), step_barriers, num_steps=num_steps, stages=stages)
  ring.start()
  plgpu.barrier_wait(input_barrier)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  column_layout = plgpu.Layout.WGMMA.reduce(0)
  g_keys = _broadcast(plgpu.load(g_smem, layout=row_layout), 1)
  weights_staging, d_scores_staging = operand_staging

  def step_body(step, carry):
    dk, dv, dg = carry
    _, query_start = step_tile(step)
    stage = ring.wait(step)
    queries, d_num = query_ring.at[stage], d_num_ring.at[stage]
    scores_t, d_weights_t = products_together([(key_smem, queries.T), (value_smem, d_num.T)], shape=(TILE, TILE))
    by_query = lambda ring: _broadcast(plgpu.load(ring.at[stage], layout=column_layout), 0)
    decay_t = _decay(g_keys, by_query(g_ring), key_tile * TILE, query_start, queries_on_rows=False)
    d_weights_t = d_weights_t + by_query(d_den_ring)
    weights_t = scores_t * scores_t * decay_t
    dg = dg - jnp.sum(weights_t * d_weights_t, axis=1)
    d_scores_t = register_operand((2.0 * scores_t * decay_t * d_weights_t).astype(dtype), d_scores_staging)
    weights_t = register_operand(weights_t.astype(dtype), weights_staging)
    dv, dk = products_together([(weights_t, d_num), (d_scores_t, queries)], inits=(dv, dk), in_place=not interpreted)
    ring.refill(step)
    return dk, dv, dg

  head_dim, value_dim = key_smem.shape[-1], value_smem.shape[-1]
  dg_init = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout)
  init = (wgmma_zeros((TILE, head_dim)), wgmma_zeros((TILE, value_dim)), dg_init)
  dk, dv, dg = lax.fori_loop(0, num_steps, step_body, init)
  store_tiles(
    [
      (dk, dk_staging, dk_ref.at[batch_kv_head, rows]),
      (dv, dv_staging, dv_ref.at[batch_kv_head, rows]),
      (dg, g_smem, dg_ref.at[batch_kv_head, rows]),
    ]
  )


def attention_forward(
  q,
  k,
  v,
  g,
  state_numerator=None,
  state_denominator=None,
  *,
  heads: int,
  kv_heads: int,
  chunk: int,
  stages: int = DEFAULT_STAGES,
  interpret=False,
):
  """The normalized outputs: `triton_kernels.query_state_attention`'s contract, with the states' part
  computed beforehand (`triton_kernels.query_state_attention(..., with_attention=False)`).

  Args:
    q: [B * heads, T, d] (scaled); k: [B * kv_heads, T, d]; v: [B * kv_heads, T, d_v]; bf16 or f16.
    g: [B * kv_heads, T] float32 cumulative log-gates within each chunk.
    state_numerator: [B * heads, T, d_v] float32, e^{G_i} phi(q_i) S, or None (no state: the
      attention form); state_denominator: [B * heads, T] float32, e^{G_i} phi(q_i) . z, with it.
    chunk, stages, interpret: as `attention_backward`.

  Returns:
    outputs [B * heads, T, d_v] in q's dtype and the denominators [B * heads, T] float32.

  Raises:
    ValueError: sizes or a dtype the kernel does not take (naming the argument).
  """
  check_inputs(KERNELS, q, value_dim=v.shape[-1], chunk=chunk, stages=stages, k=k, v=v)
  share_identical_kernels()
  states = () if state_numerator is None else (state_numerator, state_denominator.astype(jnp.float32))
  return _forward(q, k, v, g, *states, heads=heads, kv_heads=kv_heads, chunk=chunk, stages=stages, interpret=interpret)


def _program_options(heads: int, kv_heads: int, chunk: int, stages: int) -> dict:
  """The static options of a `_QueryTile` program."""
  return dict(heads=heads, group=heads // kv_heads, tiles_per_chunk=chunk // TILE, stages=stages)


def _ring(stages, width, dtype):
  return operand_smem((stages, TILE, width), dtype)


@functools.partial(jax.jit, static_argnames=("heads", "kv_heads", "chunk", "stages", "interpret"))
def _forward(q, k, v, g, *states, heads, kv_heads, chunk, stages, interpret):
  bhq, length, head_dim = q.shape
  value_dim = v.shape[-1]
  dtype = q.dtype
  with_state = bool(states)
  call = launch_grid(
    functools.partial(
      _forward_kernel,
      program_options=_program_options(heads, kv_heads, chunk, stages),
      with_state=with_state,
      interpreted=interpret,
    ),
    (jax.ShapeDtypeStruct((bhq, length, value_dim), dtype), jax.ShapeDtypeStruct((bhq, length), jnp.float32)),
    [
      operand_smem((TILE, head_dim), dtype),  # the query tile
      (plgpu.SMEM((TILE,), jnp.float32), plgpu.SMEM((TILE,), jnp.float32)),  # its log-gates; the denominators
      operand_smem((TILE, value_dim), jnp.float32),  # the states' numerator
      operand_smem((TILE, value_dim), dtype),  # the outputs' staging
      _ring(stages, head_dim, dtype),  # K tiles
      _ring(stages, value_dim, dtype),  # V tiles
      plgpu.SMEM((stages, TILE), jnp.float32),  # the key tiles' log-gates
      operand_smem((TILE, TILE), dtype) if interpret else None,  # A (interpret mode only)
      plgpu.Barrier(num_arrivals=4 if with_state else 2),
      plgpu.Barrier(num_arrivals=3, num_barriers=stages),
    ],
    grid=(bhq, length // TILE),
    grid_names=("batch_head", "query_tile"),
    interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return call(q, k, v, g.astype(jnp.float32), *states)


def attention_backward(
  q, k, v, g, d_num, d_den, *, heads: int, kv_heads: int, chunk: int, stages: int = DEFAULT_STAGES, interpret=False
):
  """Gradients of the in-chunk attention sum_j A_ij [v_j, 1]: `triton_kernels.attention_backward`'s contract.

  Args:
    q: [B * heads, T, d] (scaled); k: [B * kv_heads, T, d]; v: [B * kv_heads, T, d_v]; bf16 or f16.
    g: [B * kv_heads, T] float32 cumulative log-gates within each chunk.
    d_num: [B * heads, T, d_v] numerator cotangents in q's dtype; d_den: [B * heads, T] float32.
    chunk: the chunk length, a multiple of 64 dividing T.
    stages: depth of the rings of streamed tiles.
    interpret: run in Pallas GPU interpret mode (CPU; slow, for tests).

  Returns:
    dq [B * heads, T, d], dG from the query side [B * heads, T], dk [B * kv_heads, T, d],
    dv [B * kv_heads, T, d_v], dG from the key side [B * kv_heads, T]; all float32.

  Raises:
    ValueError: sizes or a dtype the kernels do not take (naming the argument).
  """
  check_inputs(KERNELS, q, value_dim=v.shape[-1], chunk=chunk, stages=stages, k=k, v=v, d_num=d_num)
  share_identical_kernels()
  return _kernels(
    q, k, v, g, d_num, d_den, heads=heads, kv_heads=kv_heads, chunk=chunk, stages=stages, interpret=interpret
  )


# Jitted, so that a model's layers, which call it with equal shapes, share one traced program
# (`pallas_kernels.castle.mosaic` says why).
@functools.partial(jax.jit, static_argnames=("heads", "kv_heads", "chunk", "stages", "interpret"))
def _kernels(q, k, v, g, d_num, d_den, *, heads, kv_heads, chunk, stages, interpret):
  bhq, length, head_dim = q.shape
  bhk, value_dim = k.shape[0], v.shape[-1]
  group = heads // kv_heads
  interpreted = interpret
  interpret = plgpu.InterpretGPUParams() if interpreted else None
  dtype = q.dtype
  tiles_per_chunk = chunk // TILE
  tiles = length // TILE
  g = g.astype(jnp.float32)
  d_den = d_den.astype(jnp.float32)
  staging = lambda: operand_smem((TILE, TILE), dtype) if interpreted else None
  vector = lambda: plgpu.SMEM((TILE,), jnp.float32)
  ring = functools.partial(_ring, stages)
  step_barriers = lambda arrivals: plgpu.Barrier(num_arrivals=arrivals, num_barriers=stages)

  queries_call = launch_grid(
    functools.partial(
      _queries_kernel, program_options=_program_options(heads, kv_heads, chunk, stages), interpreted=interpreted
    ),
    (jax.ShapeDtypeStruct((bhq, length, head_dim), jnp.float32), jax.ShapeDtypeStruct((bhq, length), jnp.float32)),
    [
      operand_smem((TILE, head_dim), dtype),  # the query tile
      operand_smem((TILE, value_dim), dtype),  # its dN
      (vector(), vector()),  # its log-gates (then dG's staging) and dden
      ring(head_dim, dtype),  # K tiles
      ring(value_dim, dtype),  # V tiles
      plgpu.SMEM((stages, TILE), jnp.float32),  # the key tiles' log-gates
      operand_smem((TILE, head_dim), jnp.float32),  # dQ's staging
      staging(),  # dS (interpret mode only)
      plgpu.Barrier(num_arrivals=4),
      step_barriers(3),
    ],
    grid=(bhq, tiles),
    grid_names=("batch_head", "query_tile"),
    interpret=interpret,
  )
  dq, dg_q = queries_call(q, k, v, g, d_num, d_den)

  keys_call = launch_grid(
    functools.partial(
      _keys_kernel, group=group, tiles_per_chunk=tiles_per_chunk, stages=stages, interpreted=interpreted
    ),
    (
      jax.ShapeDtypeStruct((bhk, length, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((bhk, length, value_dim), jnp.float32),
      jax.ShapeDtypeStruct((bhk, length), jnp.float32),
    ),
    [
      operand_smem((TILE, head_dim), dtype),  # the key tile
      operand_smem((TILE, value_dim), dtype),  # its values
      vector(),  # its log-gates, then dG's staging
      ring(head_dim, dtype),  # Q tiles
      ring(value_dim, dtype),  # dN tiles
      plgpu.SMEM((stages, TILE), jnp.float32),  # the query tiles' log-gates
      plgpu.SMEM((stages, TILE), jnp.float32),  # their dden
      operand_smem((TILE, head_dim), jnp.float32),  # dK's staging
      operand_smem((TILE, value_dim), jnp.float32),  # dV's staging
      (staging(), staging()),  # A^T, dS^T (interpret mode only)
      plgpu.Barrier(num_arrivals=3),
      step_barriers(4),
    ],
    grid=(bhk, tiles),
    grid_names=("batch_kv_head", "key_tile"),
    interpret=interpret,
  )
  dk, dv, dg_k = keys_call(q, k, v, g, d_num, d_den)
  return dq, dg_q, dk, dv, dg_k
