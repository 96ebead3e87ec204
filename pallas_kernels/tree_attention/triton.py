"""Hybrid tree attention (LongSpec §3.3) as one Pallas (Triton) kernel with split-K over the cache.

Verifying n drafted nodes is a decoding step with n query rows: every row reads the
whole committed cache and, besides it, a few drafted nodes under the tree mask. The
cache part has no mask but the filled length, so it is flash decoding: the cache is cut
into `splits` ranges, one program per (row block, split, batch, KV head) streams its
range in blocks of keys with an online softmax, and the splits' partial states (running
max, sum, unnormalized output) are merged in XLA (a few KB per row). The heads sharing
a KV head are rows of the same products (row r = node r // group, head r % group), so
the cache is read once per row block, not once per head.

The tree part is one more key block: the last split also folds the n drafted keys into
its state, under the tree mask expanded to rows. So one launch gives the exact softmax
over [cache ; visible nodes] and its log-sum-exp, the quantity the hybrid form merges
(LongSpec Appendix C), and n = 1 with an empty tree is a plain decoding step.

Work follows the filled length, not the capacity: each program's key blocks are its
share of ceil(length / block_keys), so a 4K prompt in a 32K cache reads 4K slots. Slots
at or past the length are never loaded (masked loads), whatever they hold.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from pallas_kernels.config_checks import SMALLEST_TILE, is_power_of_two, next_power_of_two
from pallas_kernels.split_k import merge_split_states, split_blocks
from pallas_kernels.tree_attention.rows import heads_of_rows, rows_of_heads, tree_mask_rows
from pallas_kernels.tree_attention.config import TreeAttentionTritonConfig

# 64-row blocks measured faster than 128 on an H100 (138 rows run as 3 x 64 instead of
# 2 x 128: less padding, one more pass over the cache, mostly from L2; benchmarks/RESULTS.md).
_MAX_DEFAULT_BLOCK_ROWS = 64


def supports_head_dim(head_dim: int) -> bool:
  """Whether the kernel takes this head dim: its tiles need a power of two >= 16."""
  return head_dim >= SMALLEST_TILE and is_power_of_two(head_dim)


def _block_rows(rows: int, config: TreeAttentionTritonConfig) -> int:
  if config.block_rows is not None:
    return config.block_rows
  return min(_MAX_DEFAULT_BLOCK_ROWS, max(SMALLEST_TILE, next_power_of_two(rows)))


def _splits(other_programs: int, capacity: int, config: TreeAttentionTritonConfig) -> int:
  if config.splits is not None:
    return config.splits
  by_occupancy = -(-config.target_programs // other_programs)
  by_length = max(1, capacity // (2 * config.block_keys))
  return max(1, min(by_occupancy, by_length))


def _online_softmax_step(carry, scores, values, operand_dtype, precision):
  """Folds one key block into a row block's running (max, sum, output); -inf scores are invisible."""
  running_max, running_sum, acc = carry
  new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))
  # A row that has seen nothing keeps max -inf: shift it by 0 so exp(-inf) stays 0, not NaN.
  shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
  correction = jnp.exp(running_max - shift)
  probs = jnp.exp(scores - shift)
  running_sum = running_sum * correction + jnp.sum(probs, axis=1, keepdims=True)
  acc = acc * correction + pltriton.dot(probs.astype(operand_dtype), values.astype(operand_dtype), precision=precision)
  return new_max, running_sum, acc


def _kernel(
  lengths_ref,
  q_ref,
  cache_k_ref,
  cache_v_ref,
  *refs,
  scale: float,
  block_keys: int,
  splits: int,
  tree_nodes: int,
  tree_block: int,
):
  if tree_nodes:
    tree_k_ref, tree_v_ref, visible_ref, acc_ref, max_ref, sum_ref = refs
  else:
    acc_ref, max_ref, sum_ref = refs
  split = pl.program_id(1)
  length = lengths_ref[pl.program_id(2)]
  q = q_ref[...]  # [block_rows, head_dim]
  operand_dtype = q.dtype
  # float32 inputs: full-precision products (no TF32), as the references compute.
  precision = lax.Precision.HIGHEST if operand_dtype == jnp.float32 else None

  def scores_of(keys):
    return pltriton.dot(q, keys.astype(operand_dtype), trans_b=True, precision=precision) * scale

  first, stop = split_blocks(length, split, splits=splits, block=block_keys)

  def cache_step(block, carry):
    slots = block * block_keys + jnp.arange(block_keys)
    filled = slots < length
    rows = (pl.ds(block * block_keys, block_keys), slice(None))
    keys = pltriton.load(cache_k_ref.at[rows], mask=filled[:, None], other=0.0)
    values = pltriton.load(cache_v_ref.at[rows], mask=filled[:, None], other=0.0)
    scores = jnp.where(filled[None, :], scores_of(keys), -jnp.inf)
    return _online_softmax_step(carry, scores, values, operand_dtype, precision)

  block_rows, head_dim = q.shape
  f32 = jnp.float32
  carry = (
    jnp.full((block_rows, 1), -jnp.inf, f32),
    jnp.zeros((block_rows, 1), f32),
    jnp.zeros((block_rows, head_dim), f32),
  )
  carry = lax.fori_loop(first, stop, cache_step, carry)

  if tree_nodes:

    def tree_step(_, carry):
      exists = jnp.arange(tree_block) < tree_nodes
      nodes = (pl.ds(0, tree_block), slice(None))
      keys = pltriton.load(tree_k_ref.at[nodes], mask=exists[:, None], other=0.0)
      values = pltriton.load(tree_v_ref.at[nodes], mask=exists[:, None], other=0.0)
      visible = visible_ref[...] != 0  # [block_rows, tree_block]
      scores = jnp.where(visible, scores_of(keys), -jnp.inf)
      return _online_softmax_step(carry, scores, values, operand_dtype, precision)

    # Only the last split takes the tree block (a loop of 0 or 1 trips: no branch needed;
    # Triton's loop wants its bounds of one integer type).
    trips = (split == splits - 1).astype(jnp.int32)
    carry = lax.fori_loop(jnp.int32(0), trips, tree_step, carry)

  running_max, running_sum, acc = carry
  max_ref[...] = running_max[:, 0]
  sum_ref[...] = running_sum[:, 0]
  acc_ref[...] = acc


def tree_attention_triton(
  q: jax.Array,
  cache_k: jax.Array,
  cache_v: jax.Array,
  cache_length: jax.Array,
  tree_k: jax.Array | None = None,
  tree_v: jax.Array | None = None,
  tree_mask: jax.Array | None = None,
  *,
  config: TreeAttentionTritonConfig | None = None,
  interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """Attention of n queries over a cache's filled slots and, optionally, a masked tree of n nodes.

  Shapes are checked by the public entry points (`castle_jax.ops.tree_attention`); here
  they are assumed valid, with a power-of-two head_dim >= 16.

  Args:
    q: [batch, n, heads, head_dim].
    cache_k, cache_v: [batch, capacity, kv_heads, head_dim]; heads % kv_heads == 0.
    cache_length: int32 scalar or [batch], filled slots (may be traced).
    tree_k, tree_v: [batch, n, kv_heads, head_dim] or None (the cache part alone).
    tree_mask: bool [batch, n, n] or [n, n]; [i, j] True iff node i sees node j.
    config: tiling; default `TreeAttentionTritonConfig()`.
    interpret: run in Pallas interpret mode (CPU tests).

  Returns:
    out: [batch, n, heads, head_dim] in q's dtype (0 for a row that sees no key);
    lse: float32 [batch, n, heads] (-inf for a row that sees no key).
  """
  config = config or TreeAttentionTritonConfig()
  batch, n, heads, head_dim = q.shape
  _, capacity, kv_heads, _ = cache_k.shape
  rows = n * (heads // kv_heads)
  block_rows = _block_rows(rows, config)
  row_blocks = -(-rows // block_rows)
  padded_rows = row_blocks * block_rows
  splits = _splits(row_blocks * batch * kv_heads, capacity, config)
  q_rows = rows_of_heads(q, kv_heads, padded_rows)
  lengths = jnp.broadcast_to(jnp.asarray(cache_length, jnp.int32), (batch,))

  def program(r, s, b, h):
    del r, s, b, h
    return (0,)

  rows_spec = pl.BlockSpec((None, None, block_rows, head_dim), lambda r, s, b, h: (b, h, r, 0))
  cache_spec = pl.BlockSpec((None, capacity, None, head_dim), lambda r, s, b, h: (b, 0, h, 0))
  in_specs = [pl.BlockSpec((batch,), program), rows_spec, cache_spec, cache_spec]
  inputs = [lengths, q_rows, cache_k, cache_v]
  tree_nodes = 0 if tree_k is None else n
  tree_block = max(SMALLEST_TILE, next_power_of_two(n))
  if tree_nodes:
    visible = tree_mask_rows(tree_mask, batch, heads // kv_heads, padded_rows, tree_block).astype(jnp.int32)
    tree_spec = pl.BlockSpec((None, n, None, head_dim), lambda r, s, b, h: (b, 0, h, 0))
    in_specs += [tree_spec, tree_spec, pl.BlockSpec((None, block_rows, tree_block), lambda r, s, b, h: (b, r, 0))]
    inputs += [tree_k, tree_v, visible]

  stats_shape = jax.ShapeDtypeStruct((splits, batch, kv_heads, padded_rows), jnp.float32)
  stats_spec = pl.BlockSpec((None, None, None, block_rows), lambda r, s, b, h: (s, b, h, r))
  kernel = functools.partial(
    _kernel,
    scale=head_dim**-0.5,
    block_keys=config.block_keys,
    splits=splits,
    tree_nodes=tree_nodes,
    tree_block=tree_block,
  )
  accs, maxima, sums = pl.pallas_call(
    kernel,
    grid=(row_blocks, splits, batch, kv_heads),
    in_specs=in_specs,
    out_specs=[
      pl.BlockSpec((None, None, None, block_rows, head_dim), lambda r, s, b, h: (s, b, h, r, 0)),
      stats_spec,
      stats_spec,
    ],
    out_shape=[
      jax.ShapeDtypeStruct((splits, batch, kv_heads, padded_rows, head_dim), jnp.float32),
      stats_shape,
      stats_shape,
    ],
    compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
    interpret=interpret,
    name="tree_attention",
  )(*inputs)
  out, lse = merge_split_states(maxima, sums, accs)
  return heads_of_rows(out, n, heads).astype(q.dtype), heads_of_rows(lse, n, heads)
