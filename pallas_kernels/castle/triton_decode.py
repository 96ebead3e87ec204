"""The CASTLE decoding step as one Pallas (Triton) kernel: update U, then attend, in one pass.

A decoding step of token t (Algorithm 4) is memory-bound: it touches every cached row
once or twice and does ~10 flops per byte. The XLA step reads U for the rank-1 update
(Eq. 12), writes it, and reads it again for the combining step (Eqs. 4-7). Here one
program per (split, batch, head) streams blocks of cached rows and, for each block,

  1. (CASTLE) updates the lookahead keys in registers:
     u_s += sigmoid(q^U_s . k^U_t / sqrt(d)) v^U_t for s < t, and stores them;
  2. scores the same, updated rows with the causal query:
     a_s = q^C_t . k^C_s / sqrt(d) - SiLU(q^C_t . u_s / sqrt(d)) for s <= t;
  3. folds them into an online softmax (running max, sum and weighted V^C sum).

So U is read once and written once, Q^U, K^C and V^C read once: 5 row-streams
instead of the XLA step's 6 plus its temporaries. The splits' partial softmax states
are merged in XLA (a few KB).

CASTLE-SWL updates only the W rows before t; the caller does that small update and
runs the kernel with `update_lookahead_keys=False` (attend only).

The updated rows are rounded to the cache dtype before they are scored, exactly as
the XLA step scores what it stored.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from pallas_kernels.castle.config import CastleDecodeConfig
from pallas_kernels.castle.triton_kernels import sigmoid, silu
from pallas_kernels.config_checks import is_power_of_two
from pallas_kernels.split_k import merge_split_states, split_blocks

# Programs the default split count aims for: ~30 per SM of an H100, so that enough row
# loads are in flight to saturate memory (measured: 8 splits of 576 heads beat 1-2).
_TARGET_PROGRAMS = 4096


def supports_head_dim(head_dim: int) -> bool:
  """Whether the kernel takes this head dim: its row tiles must be a power of two >= 16."""
  return head_dim >= 16 and is_power_of_two(head_dim)


def default_splits(batch_heads: int, capacity: int, block_rows: int) -> int:
  """Enough splits for ~_TARGET_PROGRAMS programs, each at least 4 blocks long."""
  by_occupancy = -(-_TARGET_PROGRAMS // batch_heads)
  by_length = max(1, capacity // (4 * block_rows))
  return max(1, min(by_occupancy, by_length))


def _decode_kernel(
  last_row_ref,
  update_end_ref,
  q_c_ref,
  k_u_ref,
  v_u_ref,
  q_u_ref,
  k_c_ref,
  v_c_ref,
  keys_in_ref,
  keys_ref,
  max_ref,
  sum_ref,
  acc_ref,
  *,
  scale: float,
  block_rows: int,
  splits: int,
  update_lookahead_keys: bool,
):
  split = pl.program_id(0)
  last_row = last_row_ref[()]  # rows 0..last_row are attended
  update_end = update_end_ref[()]  # rows < update_end get the rank-1 update
  f32 = jnp.float32
  q_c = q_c_ref[...].astype(f32)[None, :]  # [1, D]
  k_u = k_u_ref[...].astype(f32)[None, :]
  v_u = v_u_ref[...].astype(f32)[None, :]

  first, stop = split_blocks(last_row + 1, split, splits=splits, block=block_rows)

  def step(block, carry):
    running_max, running_sum, acc = carry
    positions = block * block_rows + jnp.arange(block_rows)
    cached = (positions <= last_row)[:, None]
    rows = (pl.ds(block * block_rows, block_rows), slice(None))

    def load(ref):
      # Rows past last_row may hold anything (NaN included): never read them.
      return pltriton.load(ref.at[rows], mask=cached, other=0.0).astype(f32)

    keys = load(keys_in_ref)
    if update_lookahead_keys:
      updated = (positions < update_end)[:, None]
      logits = jnp.sum(load(q_u_ref) * k_u, axis=1, keepdims=True) * scale
      keys = keys + jnp.where(updated, sigmoid(logits), 0.0) * v_u
      keys = keys.astype(keys_ref.dtype)
      pltriton.store(keys_ref.at[rows], keys, mask=updated)
      keys = keys.astype(f32)
    lookahead = jnp.sum(keys * q_c, axis=1, keepdims=True) * scale
    scores = jnp.sum(load(k_c_ref) * q_c, axis=1, keepdims=True) * scale - silu(lookahead)
    scores = jnp.where(cached, scores, -jnp.inf)  # [block_rows, 1]
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=0, keepdims=True))
    correction = jnp.exp(running_max - new_max)
    probs = jnp.exp(scores - new_max)
    running_sum = running_sum * correction + jnp.sum(probs, axis=0, keepdims=True)
    acc = acc * correction + jnp.sum(probs * load(v_c_ref), axis=0, keepdims=True)
    return new_max, running_sum, acc

  head_dim = q_c.shape[-1]
  init = (jnp.full((1, 1), -jnp.inf, f32), jnp.zeros((1, 1), f32), jnp.zeros((1, head_dim), f32))
  running_max, running_sum, acc = lax.fori_loop(first, stop, step, init)
  max_ref[...] = running_max[0]
  sum_ref[...] = running_sum[0]
  acc_ref[...] = acc[0]


def decode_attend(
  q_c,
  k_u,
  v_u,
  lookahead_queries,
  causal_keys,
  causal_values,
  lookahead_keys,
  last_row,
  update_end,
  *,
  scale: float,
  update_lookahead_keys: bool,
  config: CastleDecodeConfig | None = None,
  interpret: bool = False,
):
  """One decoding step's attention over the UQ-KV cache, optionally updating U on the way.

  The new token's rows (q^U_t, k^C_t, v^C_t, u_t = 0) must already be in the cache.

  Args:
    q_c, k_u, v_u: [batch, heads, head_dim], the new token's causal query and lookahead
      key and value.
    lookahead_queries: [batch, capacity, heads, head_dim], Q^U by position (unused, may
      be any array of that shape, when update_lookahead_keys is False).
    causal_keys, causal_values, lookahead_keys: [batch, capacity, heads, head_dim].
    last_row: int32 scalar, the new token's row t; rows 0..t are attended.
    update_end: int32 scalar; rows s < update_end get the rank-1 update (t, or 0 to
      update nothing).
    scale: the score scale (the CASTLE op passes 1/sqrt(head_dim)).
    update_lookahead_keys: False: attend only (U already updated by the caller).
    config: tiling; default `CastleDecodeConfig()`.
    interpret: run in Pallas interpret mode.

  Returns:
    output: float32 [batch, heads, head_dim]; lookahead_keys: the updated U (the input
    buffer, aliased, when update_lookahead_keys).
  """
  config = config or CastleDecodeConfig()
  batch, capacity, heads, head_dim = causal_keys.shape
  if not supports_head_dim(head_dim):
    raise ValueError(
      f"decode_attend: head_dim must be a power of two >= 16, got {head_dim}; "
      "use the XLA decoding step for other head dims"
    )
  block_rows = config.block_rows
  splits = config.splits or default_splits(batch * heads, capacity, block_rows)
  token = pl.BlockSpec((None, None, head_dim), lambda s, b, h: (b, h, 0))
  rows = pl.BlockSpec((None, capacity, None, head_dim), lambda s, b, h: (b, 0, h, 0))
  scalar = pl.BlockSpec((), lambda s, b, h: ())
  per_program = pl.BlockSpec((None, None, None, 1), lambda s, b, h: (s, b, h, 0))
  kernel = functools.partial(
    _decode_kernel, scale=scale, block_rows=block_rows, splits=splits, update_lookahead_keys=update_lookahead_keys
  )
  stats = jax.ShapeDtypeStruct((splits, batch, heads, 1), jnp.float32)
  keys, maxima, sums, acc = pl.pallas_call(
    kernel,
    grid=(splits, batch, heads),
    in_specs=[scalar, scalar, token, token, token, rows, rows, rows, rows],
    out_specs=[
      rows,
      per_program,
      per_program,
      pl.BlockSpec((None, None, None, head_dim), lambda s, b, h: (s, b, h, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct(lookahead_keys.shape, lookahead_keys.dtype),
      stats,
      stats,
      jax.ShapeDtypeStruct((splits, batch, heads, head_dim), jnp.float32),
    ],
    input_output_aliases={8: 0},
    compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name="castle_decode",
  )(
    jnp.asarray(last_row, jnp.int32),
    jnp.asarray(update_end, jnp.int32),
    q_c,
    k_u,
    v_u,
    lookahead_queries,
    causal_keys,
    causal_values,
    lookahead_keys,
  )
  output, _ = merge_split_states(maxima[..., 0], sums[..., 0], acc)
  return output, keys
