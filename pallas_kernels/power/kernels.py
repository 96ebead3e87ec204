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
unchanged. No kernel writes phi to memory: a program builds `row_group * 16` expanded
features at a time, x[:, a-group] (x) x[:, tile t], as an outer product in registers,
and feeds it straight into a tensor-core product.

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

from pallas_kernels.power.config import FEATURE_TILE, PowerKernelConfig


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


def _precision(dtype):
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _expand(x_group: jax.Array, x_tile: jax.Array, weight) -> jax.Array:
  """[rows, A] and [rows, 16] -> [rows, A * 16] float32: weight * x_group[:, a] * x_tile[:, b] at a * 16 + b."""
  rows, group = x_group.shape
  outer = x_group.astype(jnp.float32)[:, :, None] * x_tile.astype(jnp.float32)[:, None, :]
  return outer.reshape(rows, group * FEATURE_TILE) * weight


def _compiler_params(config: PowerKernelConfig):
  return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)


# ----------------------------------------------------------------------------------------------
# Update state: one program per (row block of phi, chunk, batch * kv head).


def _update_state_kernel(first_col_ref, tile_col_ref, weight_ref, x_ref, w_ref, r_ref, u_ref, state_ref,
                         normalizer_ref, *, chunk: int, block_t: int, row_group: int, precision):
  block = pl.program_id(0)
  first_col, tile_col, weight = first_col_ref[block], tile_col_ref[block], weight_ref[block]
  dtype = x_ref.dtype
  rows = row_group * FEATURE_TILE

  def step(i, carry):
    state, normalizer = carry
    tokens = pl.ds(i * block_t, block_t)
    phi = _expand(x_ref[tokens, pl.ds(first_col, row_group)], x_ref[tokens, pl.ds(tile_col, FEATURE_TILE)], weight)
    weighted = (w_ref[tokens, :].astype(jnp.float32) * r_ref[tokens][:, None]).astype(dtype)
    state += jnp.dot(phi.astype(dtype).T, weighted, precision=precision, preferred_element_type=jnp.float32)
    normalizer += jnp.sum(phi * u_ref[tokens][:, None], axis=0)
    return state, normalizer

  init = (jnp.zeros((rows, w_ref.shape[-1]), jnp.float32), jnp.zeros((rows,), jnp.float32))
  state, normalizer = lax.fori_loop(0, chunk // block_t, step, init)
  state_ref[...] = state
  normalizer_ref[...] = normalizer


def update_state(x: jax.Array, w: jax.Array, r: jax.Array, u: jax.Array, *, chunk: int,
                 config: PowerKernelConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Per-chunk states of the expanded rows of x.

  Args:
    x: [BH, T, d] (keys; queries in the backward), T a multiple of `chunk`.
    w: [BH, T, d_v] (values; output cotangents in the backward).
    r: [BH, T] float32 row weights of w.
    u: [BH, T] float32 row weights of the normalizer.

  Returns:
    state [BH, n, D, d_v] = phi(x_c)^T diag(r_c) w_c and normalizer [BH, n, D] = phi(x_c)^T u_c
    per chunk c, float32, D = `expanded_dim(d)`.
  """
  bh, length, head_dim = x.shape
  value_dim = w.shape[-1]
  num_chunks = length // chunk
  blocks = _row_blocks(head_dim, config.row_group)
  rows = config.row_group * FEATURE_TILE
  first_col = jnp.asarray([b[1] for b in blocks], jnp.int32)
  tile_col = jnp.asarray([b[2] for b in blocks], jnp.int32)
  weight = jnp.asarray([b[3] for b in blocks], jnp.float32)
  table = pl.BlockSpec((len(blocks),), lambda rb, n, b: (0,))
  kernel = functools.partial(_update_state_kernel, chunk=chunk, block_t=config.block_t, row_group=config.row_group,
                             precision=_precision(x.dtype))
  return pl.pallas_call(
      kernel,
      grid=(len(blocks), num_chunks, bh),
      in_specs=[table, table, table,
                pl.BlockSpec((None, chunk, head_dim), lambda rb, n, b: (b, n, 0)),
                pl.BlockSpec((None, chunk, value_dim), lambda rb, n, b: (b, n, 0)),
                pl.BlockSpec((None, chunk), lambda rb, n, b: (b, n)),
                pl.BlockSpec((None, chunk), lambda rb, n, b: (b, n))],
      out_specs=[pl.BlockSpec((None, None, rows, value_dim), lambda rb, n, b: (b, n, rb, 0)),
                 pl.BlockSpec((None, None, rows), lambda rb, n, b: (b, n, rb))],
      out_shape=[jax.ShapeDtypeStruct((bh, num_chunks, len(blocks) * rows, value_dim), jnp.float32),
                 jax.ShapeDtypeStruct((bh, num_chunks, len(blocks) * rows), jnp.float32)],
      compiler_params=_compiler_params(config),
      interpret=interpret,
      name="power_update_state",
  )(first_col, tile_col, weight, x, w, r, u)


# ----------------------------------------------------------------------------------------------
# Query state + intra-chunk attention + normalization: one program per (query block, batch * head).


def _query_state_products(x_ref, state_ref, normalizer_ref, *, head_dim: int, row_group: int, precision):
  """phi(x) S [rows, d_v] and phi(x) . z [rows] for the program's rows x_ref [rows, d]."""
  rows = x_ref.shape[0]
  width = row_group * FEATURE_TILE
  product = jnp.zeros((rows, state_ref.shape[-1]), jnp.float32)
  dot_normalizer = jnp.zeros((rows,), jnp.float32)
  for first_row, first_col, tile_col, weight in _row_blocks(head_dim, row_group):
    phi = _expand(x_ref[:, pl.ds(first_col, row_group)], x_ref[:, pl.ds(tile_col, FEATURE_TILE)], weight)
    state = state_ref[pl.ds(first_row, width), :]
    product += jnp.dot(phi.astype(state.dtype), state, precision=precision, preferred_element_type=jnp.float32)
    dot_normalizer += jnp.sum(phi * normalizer_ref[pl.ds(first_row, width)][None, :], axis=1)
  return product, dot_normalizer


def _causal_power_weights(q, k, g_q, g_k, q_start, k_start, precision):
  """A = (q . k)^2 e^{G_i - G_j} on and below the diagonal, 0 above; float32 [block_q, block_k]."""
  scores = jnp.dot(q, k.T, precision=precision, preferred_element_type=jnp.float32)
  rows = q_start + lax.broadcasted_iota(jnp.int32, scores.shape, 0)
  cols = k_start + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
  causal = rows >= cols
  decay = jnp.exp(jnp.where(causal, g_q[:, None] - g_k[None, :], 0.0))
  return jnp.where(causal, scores * scores * decay, 0.0)


def _query_state_attention_kernel(q_ref, k_ref, v_ref, g_ref, state_ref, normalizer_ref, out_ref, denominator_ref,
                                  *, chunk: int, block_k: int, row_group: int, precision):
  block_q, head_dim = q_ref.shape
  q_start = pl.program_id(0) * block_q
  chunk_start = (q_start // chunk) * chunk
  g_q = g_ref[pl.ds(q_start, block_q)]

  numerator, denominator = _query_state_products(q_ref, state_ref, normalizer_ref, head_dim=head_dim,
                                                 row_group=row_group, precision=precision)
  discount = jnp.exp(g_q)
  numerator *= discount[:, None]
  denominator *= discount
  q = q_ref[...]

  def step(j, carry):
    numerator, denominator = carry
    k_start = chunk_start + j * block_k
    keys = pl.ds(k_start, block_k)
    weights = _causal_power_weights(q, k_ref[keys, :], g_q, g_ref[keys], q_start, k_start, precision)
    numerator += jnp.dot(weights.astype(v_ref.dtype), v_ref[keys, :], precision=precision,
                         preferred_element_type=jnp.float32)
    return numerator, denominator + jnp.sum(weights, axis=1)

  num_key_blocks = (q_start + block_q - chunk_start + block_k - 1) // block_k
  numerator, denominator = lax.fori_loop(0, num_key_blocks, step, (numerator, denominator))
  zero = denominator == 0.0
  out_ref[...] = jnp.where(zero[:, None], 0.0, numerator / jnp.where(zero, 1.0, denominator)[:, None]).astype(
      out_ref.dtype)
  denominator_ref[...] = denominator


def _kv_index(group: int, heads: int, kv_heads: int):
  """Maps a program's batch * q-head index to its batch * kv-head index."""
  return lambda bh: (bh // heads) * kv_heads + (bh % heads) // group


def query_state_attention(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, state: jax.Array,
                          normalizer: jax.Array, *, heads: int, kv_heads: int, chunk: int,
                          config: PowerKernelConfig, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """Normalized outputs from the incoming chunk states plus the intra-chunk attention.

  Args:
    q: [B * heads, T, d], already multiplied by the score scale.
    k: [B * kv_heads, T, d]; v: [B * kv_heads, T, d_v].
    g: [B * kv_heads, T] float32 cumulative log-gates within each chunk.
    state: [B * kv_heads, n, D, d_v], the state before each chunk (cast to the product dtype).
    normalizer: [B * kv_heads, n, D] float32.

  Returns:
    outputs [B * heads, T, d_v] in q's dtype and the denominators [B * heads, T] float32.
  """
  bhq, length, head_dim = q.shape
  value_dim = v.shape[-1]
  dim = state.shape[2]
  block_q = config.block_q
  blocks_per_chunk = chunk // block_q
  kv = _kv_index(heads // kv_heads, heads, kv_heads)
  kernel = functools.partial(_query_state_attention_kernel, chunk=chunk, block_k=config.block_k,
                             row_group=config.row_group, precision=_precision(q.dtype))
  return pl.pallas_call(
      kernel,
      grid=(length // block_q, bhq),
      in_specs=[pl.BlockSpec((None, block_q, head_dim), lambda i, b: (b, i, 0)),
                pl.BlockSpec((None, length, head_dim), lambda i, b: (kv(b), 0, 0)),
                pl.BlockSpec((None, length, value_dim), lambda i, b: (kv(b), 0, 0)),
                pl.BlockSpec((None, length), lambda i, b: (kv(b), 0)),
                pl.BlockSpec((None, None, dim, value_dim), lambda i, b: (kv(b), i // blocks_per_chunk, 0, 0)),
                pl.BlockSpec((None, None, dim), lambda i, b: (kv(b), i // blocks_per_chunk, 0))],
      out_specs=[pl.BlockSpec((None, block_q, value_dim), lambda i, b: (b, i, 0)),
                 pl.BlockSpec((None, block_q), lambda i, b: (b, i))],
      out_shape=[jax.ShapeDtypeStruct((bhq, length, value_dim), q.dtype),
                 jax.ShapeDtypeStruct((bhq, length), jnp.float32)],
      compiler_params=_compiler_params(config),
      interpret=interpret,
      name="power_query_state_attention",
  )(q, k, v, g, state, normalizer)
