"""Power attention (p = 2) Pallas (Triton) kernels: fused expansion inside the matrix products.

Arrays are [batch * heads, padded_len, dim]; `padded_len` is a multiple of the chunk
size, itself a multiple of every block size. Per chunk, with G the cumulative log-gate
within the chunk and G_c its last entry (paper Sec. 4.1, Appendix F):

  update state   dS = phi(K)^T diag(r) W,  dz = phi(K)^T u      (forward: W = V, r = u = e^{G_c - G})
  query state    y  = [e^{G} phi(Q) S + A V] / [e^{G} phi(Q) z + A 1],  A_ij = (q_i . k_j)^2 e^{G_i - G_j}

The expansion phi is tspow with 16-feature tiles (`FEATURE_TILE`): for every tile pair
s <= t, the 256 features x_{s,a} x_{t,b} weighted by sqrt(2) when s < t, laid out as
castle_jax.ops.power.expansion's "tspow" with d_tile = 16 (pair-major, then a, then b),
so states move between these kernels, the XLA chunked path and the recurrent decoder
unchanged. No kernel writes phi to memory: a program builds W = `row_group * 16`
expanded features at a time in registers and feeds them straight into a tensor-core
product.

How phi is built: phi[:, c] = w * x[:, a0 + c // 16] * x[:, t0 + c % 16] for the W columns
of a row block (a0 in tile s). Both factors come out of tensor-core products of one
16-column tile of x with a 0/1 selection matrix, (x_s E_group) * (x_t E_tile), exact
because each column of E holds a single 1 (E_tile is the same for every block). That
costs two K = 16 products per block (a quarter of a state product each) but keeps every
tile in the layout the products use: the alternatives (a [rows, A, 16] outer product
reshaped to [rows, W], or gathered column loads) go through shared memory or uncoalesced
loads on every block. The backward maps gradients of phi's columns back to x's features
with the transposed selections.

Up to head dim 64 (`unrolls_tile_pairs`) the query-state and state-gradient kernels unroll
the tile pairs in Python: each pair's x_t E_tile is built once for its a-groups, and dx
has one float32 [rows, 16] accumulator per tile, known when the pair is traced. Larger heads
loop over the row blocks, reading each block's tiles from tables, and place each block's
[rows, 16] feature gradients into dx's d columns with a 0/1 placement product (rounded once
to the product dtype for it).
Sums over phi's columns (normalizers) accumulate elementwise in a [rows, W] tile and are
reduced once at the end.

Why float32 arithmetic for phi: the product of two bf16 numbers rounded once to bf16
(2^-9 relative) is the only rounding phi adds before the product.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from pallas_kernels.power.config import FEATURE_TILE, PowerTritonConfig


def tile_pairs(head_dim: int) -> list[tuple[int, int, float]]:
  """(s, t, weight) for the tile pairs s <= t in tspow order; weight sqrt(2) off the diagonal."""
  tiles = head_dim // FEATURE_TILE
  return [(s, t, 1.0 if s == t else math.sqrt(2.0)) for s in range(tiles) for t in range(s, tiles)]


def expanded_dim(head_dim: int) -> int:
  return len(tile_pairs(head_dim)) * FEATURE_TILE**2


def _row_blocks(head_dim: int, row_group: int) -> list[tuple[int, int, int, float]]:
  """(first expanded row, first column of the a-group, first column of tile t, weight) per row block."""
  blocks = []
  for pair, (s, t, weight) in enumerate(tile_pairs(head_dim)):
    for a0 in range(0, FEATURE_TILE, row_group):
      blocks.append((pair * FEATURE_TILE**2 + a0 * FEATURE_TILE, s * FEATURE_TILE + a0, t * FEATURE_TILE, weight))
  return blocks


def _block_tables(head_dim: int, row_group: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per row block: the first column of its a-group, the first column of its tile t, its weight."""
  blocks = _row_blocks(head_dim, row_group)
  return (
    jnp.asarray([b[1] for b in blocks], jnp.int32),
    jnp.asarray([b[2] for b in blocks], jnp.int32),
    jnp.asarray([b[3] for b in blocks], jnp.float32),
  )


def _table_specs(num_blocks: int) -> list:
  """BlockSpecs handing every program the whole [num_blocks] tables, for any grid rank."""
  return [pl.BlockSpec((num_blocks,), lambda *program: (0,))] * 3


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _group_selector(offset, width: int, dtype):
  """0/1 matrix [16, width]: x_s E_group repeats x_s[:, offset + c // 16] in column c (offset: the
  a-group's first feature within its tile)."""
  feature = lax.broadcasted_iota(jnp.int32, (FEATURE_TILE, width), 0)
  column = lax.broadcasted_iota(jnp.int32, (FEATURE_TILE, width), 1)
  return jnp.where(feature == offset + column // FEATURE_TILE, 1.0, 0.0).astype(dtype)


def _tile_selector(width: int, dtype):
  """0/1 matrix [16, width]: x_t E_tile is x_t[:, c % 16] in column c (the same for every row block)."""
  feature = lax.broadcasted_iota(jnp.int32, (FEATURE_TILE, width), 0)
  column = lax.broadcasted_iota(jnp.int32, (FEATURE_TILE, width), 1)
  return jnp.where(feature == column % FEATURE_TILE, 1.0, 0.0).astype(dtype)


def _selectors(first_col, width: int, dtype):
  """(E_group, E_tile) of a row block whose a-group starts at column first_col."""
  return _group_selector(first_col % FEATURE_TILE, width, dtype), _tile_selector(width, dtype)


def _tile_columns(x_ref, rows, first_col, tile_col):
  """x_s, x_t [rows, 16]: the 16-feature tiles holding a row block's a-group and its tile t."""
  group_start = pl.multiple_of(first_col // FEATURE_TILE * FEATURE_TILE, FEATURE_TILE)
  return (
    x_ref[rows, pl.ds(group_start, FEATURE_TILE)],
    x_ref[rows, pl.ds(pl.multiple_of(tile_col, FEATURE_TILE), FEATURE_TILE)],
  )


def _factors(tiles, selectors, precision):
  """(x_s E_group, x_t E_tile), float32 [rows, width]: the two factors of phi's columns."""
  return tuple(
    jnp.dot(x, selector, precision=precision, preferred_element_type=jnp.float32)
    for x, selector in zip(tiles, selectors)
  )


def _placement(start, head_dim: int, dtype):
  """0/1 matrix [16, head_dim] that puts 16 features at columns start .. start + 15."""
  feature = lax.broadcasted_iota(jnp.int32, (FEATURE_TILE, head_dim), 0)
  column = lax.broadcasted_iota(jnp.int32, (FEATURE_TILE, head_dim), 1)
  return jnp.where(column == start + feature, 1.0, 0.0).astype(dtype)


# Tile pairs a kernel unrolls at most (d <= 64): the unrolled code grows with the
# C(d / 16 + 1, 2) pairs (36 at d = 128) and its compile time with it (benchmarks/RESULTS.md),
# so larger heads loop over row blocks with their tiles' offsets read from tables.
MAX_UNROLLED_PAIRS = 10


def unrolls_tile_pairs(head_dim: int) -> bool:
  """Whether the query-state and state-gradient kernels unroll the tile pairs for this head dim."""
  return len(tile_pairs(head_dim)) <= MAX_UNROLLED_PAIRS


def _compiler_params(config: PowerTritonConfig):
  return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


# ----------------------------------------------------------------------------------------------
# Update state: one program per (row block of phi, chunk, batch * kv head).


def _update_state_kernel(
  first_col_ref,
  tile_col_ref,
  weight_ref,
  x_ref,
  w_ref,
  u_ref,
  state_ref,
  normalizer_ref,
  *,
  chunk: int,
  block_t: int,
  width: int,
  precision,
):
  block = pl.program_id(0)
  first_col, tile_col = first_col_ref[block], tile_col_ref[block]
  dtype = x_ref.dtype
  selectors = _selectors(first_col, width, dtype)

  def step(i, carry):
    state, normalizer = carry
    tokens = pl.ds(i * block_t, block_t)
    group, tile = _factors(_tile_columns(x_ref, tokens, first_col, tile_col), selectors, precision)
    phi = group * tile
    state += jnp.dot(phi.astype(dtype).T, w_ref[tokens, :], precision=precision, preferred_element_type=jnp.float32)
    return state, normalizer + phi * u_ref[tokens][:, None]

  init = (jnp.zeros((width, w_ref.shape[-1]), jnp.float32), jnp.zeros((block_t, width), jnp.float32))
  state, normalizer = lax.fori_loop(0, chunk // block_t, step, init)
  # The block's weight (sqrt(2) off the diagonal) is applied once, to the sums.
  weight = weight_ref[block]
  state_ref[...] = state * weight
  normalizer_ref[...] = jnp.sum(normalizer, axis=0) * weight


def update_state(
  x: jax.Array, w: jax.Array, u: jax.Array, *, chunk: int, config: PowerTritonConfig, interpret: bool
) -> tuple[jax.Array, jax.Array]:
  """Per-chunk states of the expanded rows of x.

  Args:
    x: [BH, T, d] (keys; queries in the backward), T a multiple of `chunk`.
    w: [BH, T, d_v] in x's dtype, rows already weighted (decayed values; output
      cotangents in the backward).
    u: [BH, T] float32 row weights of the normalizer.

  Returns:
    state [BH, n, D, d_v] = phi(x_c)^T w_c and normalizer [BH, n, D] = phi(x_c)^T u_c per
    chunk c, float32, D = `expanded_dim(d)`.
  """
  bh, length, head_dim = x.shape
  value_dim = w.shape[-1]
  num_chunks = length // chunk
  tables = _block_tables(head_dim, config.row_group)
  num_blocks = tables[0].shape[0]
  rows = config.row_group * FEATURE_TILE
  kernel = functools.partial(
    _update_state_kernel, chunk=chunk, block_t=config.block_t, width=rows, precision=_precision(x.dtype)
  )
  return pl.pallas_call(
    kernel,
    grid=(num_blocks, num_chunks, bh),
    in_specs=[
      *_table_specs(num_blocks),
      pl.BlockSpec((None, chunk, head_dim), lambda rb, n, b: (b, n, 0)),
      pl.BlockSpec((None, chunk, value_dim), lambda rb, n, b: (b, n, 0)),
      pl.BlockSpec((None, chunk), lambda rb, n, b: (b, n)),
    ],
    out_specs=[
      pl.BlockSpec((None, None, rows, value_dim), lambda rb, n, b: (b, n, rb, 0)),
      pl.BlockSpec((None, None, rows), lambda rb, n, b: (b, n, rb)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((bh, num_chunks, num_blocks * rows, value_dim), jnp.float32),
      jax.ShapeDtypeStruct((bh, num_chunks, num_blocks * rows), jnp.float32),
    ],
    compiler_params=_compiler_params(config),
    interpret=interpret,
    name="power_update_state",
  )(*tables, x, w, u)


# ----------------------------------------------------------------------------------------------
# Query state + intra-chunk attention + normalization: one program per (query block, batch * head).


def _unrolled_operands(x_ref, row_group: int):
  """What the unrolled kernels share: the row block's width W, the a-groups per tile pair, E_tile
  [16, W] and x's 16-column tiles."""
  width = row_group * FEATURE_TILE
  tiles = [x_ref[:, pl.ds(start, FEATURE_TILE)] for start in range(0, x_ref.shape[1], FEATURE_TILE)]
  return width, FEATURE_TILE // row_group, _tile_selector(width, x_ref.dtype), tiles


def _query_state_products_unrolled(x_ref, state_ref, normalizer_ref, *, row_group: int, precision):
  """phi(x) S [rows, d_v] and phi(x) . z [rows] for the program's rows x_ref [rows, d].

  The tile pairs (s, t) are a Python loop, so that each pair's x_t E_tile factor (with the
  pair's weight) is built once for its a-groups; only the a-groups are a loop on the device."""
  rows, head_dim = x_ref.shape
  dtype = x_ref.dtype
  width, groups, tile_selector, x_tiles = _unrolled_operands(x_ref, row_group)
  carry = (jnp.zeros((rows, state_ref.shape[-1]), jnp.float32), jnp.zeros((rows, width), jnp.float32))
  for pair, (s, t, weight) in enumerate(tile_pairs(head_dim)):
    tile_factor = jnp.dot(x_tiles[t], tile_selector, precision=precision, preferred_element_type=jnp.float32) * weight

    def step(a, carry, pair=pair, s=s, tile_factor=tile_factor):
      product, dot_normalizer = carry
      group_selector = _group_selector(a * row_group, width, dtype)
      phi = jnp.dot(x_tiles[s], group_selector, precision=precision, preferred_element_type=jnp.float32) * tile_factor
      block_rows = pl.ds((pair * groups + a) * width, width)
      state = state_ref[block_rows, :]
      product += jnp.dot(phi.astype(state.dtype), state, precision=precision, preferred_element_type=jnp.float32)
      return product, dot_normalizer + phi * normalizer_ref[block_rows][None, :]

    carry = lax.fori_loop(0, groups, step, carry)
  product, dot_normalizer = carry
  return product, jnp.sum(dot_normalizer, axis=1)


def _query_state_products_looped(tables, x_ref, state_ref, normalizer_ref, *, row_group: int, precision):
  """`_query_state_products_unrolled` as one loop over the row blocks (any head dim)."""
  first_col_ref, tile_col_ref, weight_ref = tables
  rows = x_ref.shape[0]
  width = row_group * FEATURE_TILE
  every_row = pl.ds(0, rows)

  def step(block, carry):
    product, dot_normalizer = carry
    first_col = first_col_ref[block]
    group, tile = _factors(
      _tile_columns(x_ref, every_row, first_col, tile_col_ref[block]),
      _selectors(first_col, width, x_ref.dtype),
      precision,
    )
    phi = group * tile * weight_ref[block]
    block_rows = pl.ds(block * width, width)
    state = state_ref[block_rows, :]
    product += jnp.dot(phi.astype(state.dtype), state, precision=precision, preferred_element_type=jnp.float32)
    return product, dot_normalizer + phi * normalizer_ref[block_rows][None, :]

  init = (jnp.zeros((rows, state_ref.shape[-1]), jnp.float32), jnp.zeros((rows, width), jnp.float32))
  product, dot_normalizer = lax.fori_loop(0, first_col_ref.shape[0], step, init)
  return product, jnp.sum(dot_normalizer, axis=1)


def _scores_and_decay(q, k, g_q, g_k, q_start, k_start, precision):
  """q . k and the causal decay e^{G_i - G_j} (0 above the diagonal); float32 [block_q, block_k].

  The power weights of the block are A = scores^2 * decay.
  """
  scores = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
  rows = q_start + lax.broadcasted_iota(jnp.int32, scores.shape, 0)
  cols = k_start + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
  causal = rows >= cols
  # Above the diagonal G_i - G_j >= 0 could overflow exp: select before exponentiating.
  return scores, jnp.where(causal, jnp.exp(jnp.where(causal, g_q[:, None] - g_k[None, :], 0.0)), 0.0)


def _query_state_attention_kernel(
  first_col_ref,
  tile_col_ref,
  weight_ref,
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  *refs,
  chunk: int,
  block_k: int,
  row_group: int,
  with_state: bool,
  with_attention: bool,
  precision,
):
  state_refs, (out_ref, denominator_ref) = refs[:-2], refs[-2:]
  block_q = q_ref.shape[0]
  q_start = pl.program_id(0) * block_q
  chunk_start = (q_start // chunk) * chunk
  g_q = g_ref[pl.ds(q_start, block_q)]

  if with_state:
    if unrolls_tile_pairs(q_ref.shape[-1]):
      products = _query_state_products_unrolled(q_ref, *state_refs, row_group=row_group, precision=precision)
    else:
      tables = (first_col_ref, tile_col_ref, weight_ref)
      products = _query_state_products_looped(tables, q_ref, *state_refs, row_group=row_group, precision=precision)
    numerator, denominator = products
    discount = jnp.exp(g_q)
    numerator *= discount[:, None]
    denominator *= discount
  else:
    numerator = jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32)
    denominator = jnp.zeros((block_q,), jnp.float32)
  if not with_attention:
    out_ref[...] = numerator
    denominator_ref[...] = denominator
    return
  q = q_ref[...]

  def step(j, carry):
    numerator, denominator = carry
    k_start = chunk_start + j * block_k
    keys = pl.ds(k_start, block_k)
    scores, decay = _scores_and_decay(q, k_ref[keys, :], g_q, g_ref[keys], q_start, k_start, precision)
    weights = scores * scores * decay
    numerator += jnp.dot(
      weights.astype(v_ref.dtype), v_ref[keys, :], precision=precision, preferred_element_type=jnp.float32
    )
    return numerator, denominator + jnp.sum(weights, axis=1)

  num_key_blocks = (q_start + block_q - chunk_start + block_k - 1) // block_k
  numerator, denominator = lax.fori_loop(0, num_key_blocks, step, (numerator, denominator))
  zero = denominator == 0.0
  out_ref[...] = jnp.where(zero[:, None], 0.0, numerator / jnp.where(zero, 1.0, denominator)[:, None]).astype(
    out_ref.dtype
  )
  denominator_ref[...] = denominator


def _kv_index(group: int, heads: int, kv_heads: int):
  """Maps a program's batch * q-head index to its batch * kv-head index."""
  return lambda bh: (bh // heads) * kv_heads + (bh % heads) // group


def query_state_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  state: jax.Array | None,
  normalizer: jax.Array | None,
  *,
  heads: int,
  kv_heads: int,
  chunk: int,
  config: PowerTritonConfig,
  interpret: bool,
  with_attention: bool = True,
) -> tuple[jax.Array, jax.Array]:
  """Normalized outputs from the incoming chunk states plus the intra-chunk attention.

  Args:
    q: [B * heads, T, d], already multiplied by the score scale.
    k: [B * kv_heads, T, d]; v: [B * kv_heads, T, d_v].
    g: [B * kv_heads, T] float32 cumulative log-gates within each chunk.
    state: [B * kv_heads, n, D, d_v], the state before each chunk (cast to the product
      dtype), or None: no state enters any chunk (the attention form alone).
    normalizer: [B * kv_heads, n, D] float32, or None with state None.
    with_attention: False leaves out the intra-chunk attention and the normalization (with a
      state only): then the states' numerators e^{G_i} phi(q_i) S and denominators, float32.

  Returns:
    outputs [B * heads, T, d_v] in q's dtype and the denominators [B * heads, T] float32.
  """
  if not (with_attention or state is not None):
    raise ValueError("query_state_attention(with_attention=False) needs a state")
  bhq, length, head_dim = q.shape
  value_dim = v.shape[-1]
  block_q = config.block_q
  kv = _kv_index(heads // kv_heads, heads, kv_heads)
  tables = _block_tables(head_dim, config.row_group)
  with_state = state is not None
  state_specs, state_args = [], []
  if with_state:
    dim = state.shape[2]
    blocks_per_chunk = chunk // block_q
    state_specs = [
      pl.BlockSpec((None, None, dim, value_dim), lambda i, b: (kv(b), i // blocks_per_chunk, 0, 0)),
      pl.BlockSpec((None, None, dim), lambda i, b: (kv(b), i // blocks_per_chunk, 0)),
    ]
    state_args = [state, normalizer]
  kernel = functools.partial(
    _query_state_attention_kernel,
    chunk=chunk,
    block_k=config.block_k,
    row_group=config.row_group,
    with_state=with_state,
    with_attention=with_attention,
    precision=_precision(q.dtype),
  )
  return pl.pallas_call(
    kernel,
    grid=(length // block_q, bhq),
    in_specs=[
      *_table_specs(tables[0].shape[0]),
      pl.BlockSpec((None, block_q, head_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, length, head_dim), lambda i, b: (kv(b), 0, 0)),
      pl.BlockSpec((None, length, value_dim), lambda i, b: (kv(b), 0, 0)),
      pl.BlockSpec((None, length), lambda i, b: (kv(b), 0)),
      *state_specs,
    ],
    out_specs=[
      pl.BlockSpec((None, block_q, value_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, block_q), lambda i, b: (b, i)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((bhq, length, value_dim), q.dtype if with_attention else jnp.float32),
      jax.ShapeDtypeStruct((bhq, length), jnp.float32),
    ],
    compiler_params=_compiler_params(config),
    interpret=interpret,
    name=("power_query_state_attention" if with_attention else "power_query_state")
    if with_state
    else "power_attention_form",
  )(*tables, q, k, v, g, *state_args)


# ----------------------------------------------------------------------------------------------
# Backward: gradients through a state product, and the intra-chunk attention.


def _state_gradient_unrolled(
  x_ref, cotangent, cotangent_normalizer, state_ref, normalizer_ref, *, with_product, row_group, precision
):
  """dx as (first column, x tile, dx tile) pieces of 16 columns, and phi(x) S (with_product).

  The tile pairs (s, t) are a Python loop, so each pair's two tiles of dx are accumulators of
  their own ([rows, 16] each) and the pair's x_t E_tile factor is built once for its a-groups;
  only the a-groups of a pair are a loop on the device."""
  rows, head_dim = x_ref.shape
  dtype = x_ref.dtype
  width, groups, tile_selector, x_tiles = _unrolled_operands(x_ref, row_group)
  dx_tiles = [jnp.zeros((rows, FEATURE_TILE), jnp.float32) for _ in x_tiles]
  product = jnp.zeros((rows, state_ref.shape[-1] if with_product else FEATURE_TILE), jnp.float32)

  for pair, (s, t, weight) in enumerate(tile_pairs(head_dim)):
    tile_factor = jnp.dot(x_tiles[t], tile_selector, precision=precision, preferred_element_type=jnp.float32)

    def step(a, carry, pair=pair, s=s, t=t, weight=weight, tile_factor=tile_factor):
      dx_s, dx_t, product = carry
      group_selector = _group_selector(a * row_group, width, dtype)
      group_factor = jnp.dot(x_tiles[s], group_selector, precision=precision, preferred_element_type=jnp.float32)
      block_rows = pl.ds((pair * groups + a) * width, width)
      state = state_ref[block_rows, :]  # [W, d_v]
      m = jnp.dot(cotangent, state.T, precision=precision, preferred_element_type=jnp.float32)
      m = (m + cotangent_normalizer[:, None] * normalizer_ref[block_rows][None, :]) * weight
      # d/dx of sum_c m_c (x_s E_group)_c (x_t E_tile)_c, through the transposed selections to
      # each tile's 16 features.
      dx_s += jnp.dot(
        (m * tile_factor).astype(dtype), group_selector.T, precision=precision, preferred_element_type=jnp.float32
      )
      d_t = jnp.dot(
        (m * group_factor).astype(dtype), tile_selector.T, precision=precision, preferred_element_type=jnp.float32
      )
      if s == t:
        dx_s += d_t
      else:
        dx_t += d_t
      if with_product:
        phi = (group_factor * tile_factor * weight).astype(state.dtype)
        product += jnp.dot(phi, state, precision=precision, preferred_element_type=jnp.float32)
      return dx_s, dx_t, product

    # On the diagonal (s = t) both terms go to dx_s; the second accumulator is a placeholder.
    dx_t_init = dx_tiles[t] if s != t else jnp.zeros((rows, FEATURE_TILE), jnp.float32)
    dx_tiles[s], dx_t, product = lax.fori_loop(0, groups, step, (dx_tiles[s], dx_t_init, product))
    if s != t:
      dx_tiles[t] = dx_t
  return [(index * FEATURE_TILE, x, dx) for index, (x, dx) in enumerate(zip(x_tiles, dx_tiles))], product


def _state_gradient_looped(
  tables, x_ref, cotangent, cotangent_normalizer, state_ref, normalizer_ref, *, with_product, row_group, precision
):
  """`_state_gradient_unrolled` as one loop over the row blocks (any head dim): each block's
  [rows, 16] feature gradients go to dx's d columns through a 0/1 placement product."""
  first_col_ref, tile_col_ref, weight_ref = tables
  rows, head_dim = x_ref.shape
  dtype = x_ref.dtype
  width = row_group * FEATURE_TILE
  every_row = pl.ds(0, rows)

  def step(block, carry):
    dx, product = carry
    first_col, tile_col = first_col_ref[block], tile_col_ref[block]
    selectors = _selectors(first_col, width, dtype)
    group, tile = _factors(_tile_columns(x_ref, every_row, first_col, tile_col), selectors, precision)
    block_rows = pl.ds(block * width, width)
    state = state_ref[block_rows, :]  # [W, d_v]
    weight = weight_ref[block]
    m = jnp.dot(cotangent, state.T, precision=precision, preferred_element_type=jnp.float32)
    m = (m + cotangent_normalizer[:, None] * normalizer_ref[block_rows][None, :]) * weight
    for factor, selector, start in (
      (tile, selectors[0], first_col // FEATURE_TILE * FEATURE_TILE),
      (group, selectors[1], tile_col),
    ):
      d_features = jnp.dot(
        (m * factor).astype(dtype), selector.T, precision=precision, preferred_element_type=jnp.float32
      )
      dx += jnp.dot(
        d_features.astype(dtype),
        _placement(start, head_dim, dtype),
        precision=precision,
        preferred_element_type=jnp.float32,
      )
    if with_product:
      phi = (group * tile * weight).astype(state.dtype)
      product += jnp.dot(phi, state, precision=precision, preferred_element_type=jnp.float32)
    return dx, product

  value_dim = state_ref.shape[-1] if with_product else FEATURE_TILE
  init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.zeros((rows, value_dim), jnp.float32))
  dx, product = lax.fori_loop(0, first_col_ref.shape[0], step, init)
  return [(0, x_ref[...], dx)], product


def _state_gradient_kernel(
  first_col_ref,
  tile_col_ref,
  weight_ref,
  x_ref,
  cotangent_ref,
  cotangent_normalizer_ref,
  state_ref,
  normalizer_ref,
  dx_ref,
  phi_dot_ref,
  *product_refs,
  row_group: int,
  precision,
):
  """dx and phi(x) . M for M_i = S c_i + z c^z_i; optionally phi(x) S."""
  inputs = (x_ref, cotangent_ref[...], cotangent_normalizer_ref[...], state_ref, normalizer_ref)
  options = dict(with_product=bool(product_refs), row_group=row_group, precision=precision)
  if unrolls_tile_pairs(x_ref.shape[-1]):
    pieces, product = _state_gradient_unrolled(*inputs, **options)
  else:
    pieces, product = _state_gradient_looped((first_col_ref, tile_col_ref, weight_ref), *inputs, **options)
  # phi(x) . M is a homogeneous quadratic in x, so x . d/dx = 2 phi(x) . M (Euler): no
  # running sum over phi's columns needed.
  phi_dot = jnp.zeros((x_ref.shape[0],), jnp.float32)
  for start, x, dx in pieces:
    dx_ref[:, pl.ds(start, dx.shape[1])] = dx
    phi_dot += jnp.sum(x.astype(jnp.float32) * dx, axis=1)
  phi_dot_ref[...] = 0.5 * phi_dot
  if product_refs:
    product_refs[0][...] = product


def state_gradient(
  x: jax.Array,
  cotangent: jax.Array,
  cotangent_normalizer: jax.Array,
  state: jax.Array,
  normalizer: jax.Array,
  *,
  heads: int,
  kv_heads: int,
  chunk: int,
  config: PowerTritonConfig,
  interpret: bool,
  with_product: bool = False,
):
  """Gradient through f_i = phi(x_i) . (S c_i + z c^z_i) with S, z the state of x_i's chunk.

  Args:
    x: [B * heads, T, d]; cotangent c: [B * heads, T, d_v] (product dtype);
    cotangent_normalizer c^z: [B * heads, T] float32.
    state: [B * kv_heads, n, D, d_v] (product dtype); normalizer: [B * kv_heads, n, D] float32.
    with_product: also return phi(x_i) S (the forward state product).

  Returns:
    dx [B * heads, T, d] float32 (d f / d x), phi(x) . M [B * heads, T] float32 (= f), and
    with_product phi(x) S [B * heads, T, d_v] float32.
  """
  bh, length, head_dim = x.shape
  value_dim = cotangent.shape[-1]
  dim = state.shape[2]
  block = config.grad_block
  blocks_per_chunk = chunk // block
  kv = _kv_index(heads // kv_heads, heads, kv_heads)
  rows_spec = lambda width: pl.BlockSpec((None, block, width), lambda i, b: (b, i, 0))
  vector_spec = pl.BlockSpec((None, block), lambda i, b: (b, i))
  out_specs = [rows_spec(head_dim), vector_spec]
  out_shape = [
    jax.ShapeDtypeStruct((bh, length, head_dim), jnp.float32),
    jax.ShapeDtypeStruct((bh, length), jnp.float32),
  ]
  if with_product:
    out_specs.append(rows_spec(value_dim))
    out_shape.append(jax.ShapeDtypeStruct((bh, length, value_dim), jnp.float32))
  tables = _block_tables(head_dim, config.row_group)
  kernel = functools.partial(_state_gradient_kernel, row_group=config.row_group, precision=_precision(x.dtype))
  return pl.pallas_call(
    kernel,
    grid=(length // block, bh),
    in_specs=[
      *_table_specs(tables[0].shape[0]),
      rows_spec(head_dim),
      rows_spec(value_dim),
      vector_spec,
      pl.BlockSpec((None, None, dim, value_dim), lambda i, b: (kv(b), i // blocks_per_chunk, 0, 0)),
      pl.BlockSpec((None, None, dim), lambda i, b: (kv(b), i // blocks_per_chunk, 0)),
    ],
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=pltriton.CompilerParams(num_warps=config.grad_num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name="power_state_gradient",
  )(*tables, x, cotangent, cotangent_normalizer, state, normalizer)


def _attention_terms(q, k, v, d_num, d_den, g_q, g_k, q_start, k_start, precision):
  """For one block pair: the weights A, dA = dN V^T + dden, and d scores (float32)."""
  scores, decay = _scores_and_decay(q, k, g_q, g_k, q_start, k_start, precision)
  weights = scores * scores * decay
  d_weights = jnp.dot(d_num, v.T, precision=precision, preferred_element_type=jnp.float32) + d_den[:, None]
  return weights, d_weights, 2.0 * scores * decay * d_weights


def _attention_dq_kernel(
  q_ref, k_ref, v_ref, g_ref, d_num_ref, d_den_ref, dq_ref, dg_ref, *, chunk: int, block_k: int, precision
):
  block_q = q_ref.shape[0]
  q_start = pl.program_id(0) * block_q
  chunk_start = (q_start // chunk) * chunk
  q, d_num, d_den = q_ref[...], d_num_ref[...], d_den_ref[...]
  g_q = g_ref[pl.ds(q_start, block_q)]

  def step(j, carry):
    dq, dg = carry
    k_start = chunk_start + j * block_k
    keys = pl.ds(k_start, block_k)
    k = k_ref[keys, :]
    weights, d_weights, d_scores = _attention_terms(
      q, k, v_ref[keys, :], d_num, d_den, g_q, g_ref[keys], q_start, k_start, precision
    )
    dq += jnp.dot(d_scores.astype(k.dtype), k, precision=precision, preferred_element_type=jnp.float32)
    return dq, dg + jnp.sum(weights * d_weights, axis=1)

  num_key_blocks = (q_start + block_q - chunk_start + block_k - 1) // block_k
  dq, dg = lax.fori_loop(0, num_key_blocks, step, (jnp.zeros(q.shape, jnp.float32), jnp.zeros((block_q,), jnp.float32)))
  dq_ref[...] = dq
  dg_ref[...] = dg


def _attention_dkv_kernel(
  q_ref,
  k_ref,
  v_ref,
  g_ref,
  d_num_ref,
  d_den_ref,
  dk_ref,
  dv_ref,
  dg_ref,
  *,
  chunk: int,
  block_q: int,
  group: int,
  precision,
):
  block_k = k_ref.shape[0]
  k_start = pl.program_id(0) * block_k
  chunk_end = (k_start // chunk + 1) * chunk
  k, v = k_ref[...], v_ref[...]
  g_k = g_ref[pl.ds(k_start, block_k)]
  first = (k_start // block_q) * block_q
  num_query_blocks = (chunk_end - first) // block_q

  def step(j, carry):
    dk, dv, dg = carry
    head, i = j // num_query_blocks, j % num_query_blocks
    q_start = first + i * block_q
    queries = pl.ds(q_start, block_q)
    q, d_num = q_ref[head, queries, :], d_num_ref[head, queries, :]
    weights, d_weights, d_scores = _attention_terms(
      q, k, v, d_num, d_den_ref[head, queries], g_ref[queries], g_k, q_start, k_start, precision
    )
    dk += jnp.dot(d_scores.T.astype(q.dtype), q, precision=precision, preferred_element_type=jnp.float32)
    dv += jnp.dot(weights.T.astype(d_num.dtype), d_num, precision=precision, preferred_element_type=jnp.float32)
    return dk, dv, dg - jnp.sum(weights * d_weights, axis=0)

  init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32), jnp.zeros((block_k,), jnp.float32))
  dk, dv, dg = lax.fori_loop(0, group * num_query_blocks, step, init)
  dk_ref[...] = dk
  dv_ref[...] = dv
  dg_ref[...] = dg


def attention_backward(
  q, k, v, g, d_num, d_den, *, heads: int, kv_heads: int, chunk: int, config: PowerTritonConfig, interpret: bool
):
  """Gradients of the intra-chunk attention sum_j A_ij [v_j, 1] (the numerator and denominator).

  Args:
    q: [B * heads, T, d] (scaled); k: [B * kv_heads, T, d]; v: [B * kv_heads, T, d_v].
    g: [B * kv_heads, T] float32 cumulative log-gates within each chunk.
    d_num: [B * heads, T, d_v] numerator cotangents (product dtype); d_den: [B * heads, T] float32.

  Returns:
    dq [B * heads, T, d], dG from the query side [B * heads, T], dk [B * kv_heads, T, d],
    dv [B * kv_heads, T, d_v], dG from the key side [B * kv_heads, T]; all float32.
  """
  bhq, length, head_dim = q.shape
  bhk, value_dim = k.shape[0], v.shape[-1]
  group = heads // kv_heads
  block_q, block_k = config.block_q, config.block_k
  precision = _precision(q.dtype)
  kv = _kv_index(group, heads, kv_heads)
  full = lambda width, index: pl.BlockSpec((None, length, width), lambda i, b: (index(b), 0, 0))
  same = lambda b: b
  dq, dg_q = pl.pallas_call(
    functools.partial(_attention_dq_kernel, chunk=chunk, block_k=block_k, precision=precision),
    grid=(length // block_q, bhq),
    in_specs=[
      pl.BlockSpec((None, block_q, head_dim), lambda i, b: (b, i, 0)),
      full(head_dim, kv),
      full(value_dim, kv),
      pl.BlockSpec((None, length), lambda i, b: (kv(b), 0)),
      pl.BlockSpec((None, block_q, value_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, block_q), lambda i, b: (b, i)),
    ],
    out_specs=[
      pl.BlockSpec((None, block_q, head_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, block_q), lambda i, b: (b, i)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((bhq, length, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((bhq, length), jnp.float32),
    ],
    compiler_params=_compiler_params(config),
    interpret=interpret,
    name="power_attention_dq",
  )(q, k, v, g, d_num, d_den)
  # A kv head's query heads are `group` consecutive rows of the folded q: one block of that size.
  grouped = lambda width: pl.BlockSpec((group, length, width), lambda i, b: (b, 0, 0))
  dk, dv, dg_k = pl.pallas_call(
    functools.partial(_attention_dkv_kernel, chunk=chunk, block_q=block_q, group=group, precision=precision),
    grid=(length // block_k, bhk),
    in_specs=[
      grouped(head_dim),
      pl.BlockSpec((None, block_k, head_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, block_k, value_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, length), lambda i, b: (same(b), 0)),
      grouped(value_dim),
      pl.BlockSpec((group, length), lambda i, b: (b, 0)),
    ],
    out_specs=[
      pl.BlockSpec((None, block_k, head_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, block_k, value_dim), lambda i, b: (b, i, 0)),
      pl.BlockSpec((None, block_k), lambda i, b: (b, i)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((bhk, length, head_dim), jnp.float32),
      jax.ShapeDtypeStruct((bhk, length, value_dim), jnp.float32),
      jax.ShapeDtypeStruct((bhk, length), jnp.float32),
    ],
    compiler_params=_compiler_params(config),
    interpret=interpret,
    name="power_attention_dkv",
  )(q, k, v, g, d_num, d_den)
  return dq, dg_q, dk, dv, dg_k
