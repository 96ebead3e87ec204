"""GCA through the Pallas Triton kernels, differentiable with a custom VJP.

`gca_attention_triton` (`gca_attention(implementation="triton")`) takes the layout of the
GCA entry point, views the
queries as [batch, query_chunks, query_len, heads, head_dim] (a reshape), zero-pads each
query chunk to its query blocks (`triton_kernels.Tiling.segments`) and each memory chunk to a
power-of-two tile, and runs `triton_kernels.forward`; the custom VJP runs `triton_kernels.backward_queries` (dQ, dw)
and `triton_kernels.backward_memory` (dK, dV). Padding is exact: padded keys are masked out
of every softmax_1, padded query rows are sliced off (and their cotangent is zero).

The memory side of the backward needs, for each memory chunk, the (query chunk, slot)
pairs that retrieved it: a stable argsort of the flat chunk indices and the start of
each chunk's run in it (`pairs.retrieving_pairs`), O(query_chunks * k) integers per sequence.

There is no decoding kernel: DRT's token-by-token step calls the same op over the one
query chunk it touches (a few rows against k retrieved chunks), where these kernels and
the XLA path both cost little more than a launch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.config_checks import SMALLEST_TILE, is_power_of_two, next_power_of_two
from pallas_kernels.gca import triton_kernels, padding, triton_shared_memory
from pallas_kernels.gca.config import GcaTritonConfig, default_triton_config
from pallas_kernels.gca.pairs import retrieving_pairs
from pallas_kernels.residuals import keep_for_backward

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# A memory chunk is one key tile (see `triton_kernels`); beyond 256 keys its score tile no
# longer fits a program's registers.
MAX_CHUNK_LEN = 256
MAX_HEAD_DIM = 256
# Rows per query chunk that `unsupported_reason` assumes when not told: past two query
# blocks of any config, so its tiles are the largest that config makes.
_LONG_QUERY_CHUNK = 1 << 16


def _largest_power_of_two_dividing(n: int) -> int:
  return n & -n


def unsupported_reason(
  *,
  head_dim: int,
  chunk_len: int,
  heads: int,
  kv_heads: int,
  dtype,
  config: GcaTritonConfig | None = None,
  query_len: int | None = None,
) -> str | None:
  """Why the Triton kernels cannot run inputs of these sizes (a message naming the argument
  and the fix), or None. Takes sizes, not arrays, so a caller can ask before any array exists.

  Includes the shared-memory budget (`triton_shared_memory`): an explicit `config` is checked as
  given, the default after `config_for` has lowered its stages. The memory-side backward's
  pipelined tiles grow with the query chunk's rows, so without `query_len` (rows per query
  chunk) that kernel is checked at one stage only, the floor of the default's rule;
  `gca_attention_triton` checks again with it.
  """
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"implementation='triton' takes {[jnp.dtype(d).name for d in SUPPORTED_DTYPES]} queries, got "
      f"{jnp.dtype(dtype).name}; cast them or use implementation='xla'"
    )
  if not is_power_of_two(head_dim) or not SMALLEST_TILE <= head_dim <= MAX_HEAD_DIM:
    return (
      f"implementation='triton' needs a power-of-two head_dim in [{SMALLEST_TILE}, {MAX_HEAD_DIM}], got "
      f"{head_dim}; use implementation='xla'"
    )
  if chunk_len > MAX_CHUNK_LEN:
    return (
      f"implementation='triton' takes memory chunks of at most {MAX_CHUNK_LEN} keys (chunk_k's chunk_len), "
      f"got {chunk_len}; use implementation='xla'"
    )
  per_program = (config or default_triton_config()).heads_per_program
  if per_program is not None and (heads // kv_heads) % per_program:
    return (
      f"GcaTritonConfig.heads_per_program ({per_program}) must divide the query heads per kv head "
      f"({heads} // {kv_heads}); pick a power of two that does, or None"
    )
  group = heads // kv_heads
  if query_len is not None:
    config, tiling = config_for(
      config, query_len=query_len, group=group, chunk_len=chunk_len, head_dim=head_dim, dtype=dtype
    )
    return triton_shared_memory.over_budget_reason(config, tiling, head_dim, dtype)
  # Rows per query chunk unknown: a stand-in long enough for the largest query tiles.
  config, tiling = config_for(
    config, query_len=_LONG_QUERY_CHUNK, group=group, chunk_len=chunk_len, head_dim=head_dim, dtype=dtype
  )
  return triton_shared_memory.over_budget_reason(
    config, tiling, head_dim, dtype, ("forward", "backward_queries")
  ) or triton_shared_memory.over_budget_reason(
    dataclasses.replace(config, memory_num_stages=1), tiling, head_dim, dtype, ("backward_memory",)
  )


def config_for(
  config: GcaTritonConfig | None, *, query_len: int, group: int, chunk_len: int, head_dim: int, dtype
) -> tuple[GcaTritonConfig, triton_kernels.Tiling]:
  """(config, tiling) to run: an explicit `config` as given; None: `default_triton_config()` with
  the stages of any kernel whose tiles would exceed the shared-memory budget lowered to 1
  (`triton_shared_memory.fit_stages`; the drt_128m shape, 12 heads x 64, 64-row query chunks and
  63-key chunks, keeps every default)."""
  if config is not None:
    return config, tiling_for(query_len, group, chunk_len, config)
  config = default_triton_config()
  tiling = tiling_for(query_len, group, chunk_len, config)
  return triton_shared_memory.fit_stages(config, tiling, head_dim, dtype), tiling


def tiling_for(query_len: int, group: int, chunk_len: int, config: GcaTritonConfig) -> triton_kernels.Tiling:
  """The static tile sizes for query chunks of `query_len` rows, `group` query heads per kv
  head and memory chunks of `chunk_len` keys."""
  query_rows = max(SMALLEST_TILE, next_power_of_two(query_len))
  if config.heads_per_program is None:
    block_q = min(config.block_rows, query_rows)
    per_program = min(_largest_power_of_two_dividing(group), max(1, config.block_rows // block_q))
  else:
    per_program = config.heads_per_program
    block_q = min(max(SMALLEST_TILE, config.block_rows // per_program), query_rows)
  return triton_kernels.Tiling(
    query_len=query_len,
    block_q=block_q,
    heads_per_program=per_program,
    group=group,
    chunk_len=chunk_len,
    padded_chunk_len=max(SMALLEST_TILE, next_power_of_two(chunk_len)),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _gca(queries, keys, values, weights, indices, tiling, scale, config, interpret):
  return triton_kernels.forward(
    queries, keys, values, weights, indices, tiling=tiling, scale=scale, config=config, interpret=interpret
  )[0]


def _gca_fwd(queries, keys, values, weights, indices, tiling, scale, config, interpret):
  out, lse = keep_for_backward(
    triton_kernels.forward(
      queries, keys, values, weights, indices, tiling=tiling, scale=scale, config=config, interpret=interpret
    )
  )
  # O(T k) residuals beyond the inputs: one float32 log-normalizer per row, head and slot.
  return out, (queries, keys, values, weights, indices, lse)


def _gca_bwd(tiling, scale, config, interpret, residuals, d_out):
  queries, keys, values, weights, indices, lse = residuals
  options = dict(tiling=tiling, scale=scale, config=config, interpret=interpret)
  d_out = d_out.astype(queries.dtype)
  d_queries, delta, d_weights = triton_kernels.backward_queries(
    queries, keys, values, weights, indices, lse, d_out, **options
  )
  order, starts = retrieving_pairs(indices, weights, keys.shape[1])
  d_keys, d_values = triton_kernels.backward_memory(
    queries, keys, values, weights, lse, delta, d_out, order, starts, **options
  )
  return d_queries, d_keys, d_values, d_weights, None


_gca.defvjp(_gca_fwd, _gca_bwd)


def gca_attention_triton(
  q: jax.Array,
  chunk_k: jax.Array,
  chunk_v: jax.Array,
  chunk_weights: jax.Array,
  chunk_indices: jax.Array,
  *,
  scale: float,
  config: GcaTritonConfig | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """GCA through the Triton kernels (shapes already checked by the caller).

  Args:
    q: [batch, seq, heads, head_dim], seq = query_chunks * query_len; head_dim a power of
      two in [16, 256].
    chunk_k, chunk_v: [batch, memory_chunks, chunk_len, kv_heads, head_dim], chunk_len <= 256.
    chunk_weights: float [batch, query_chunks, k].
    chunk_indices: int [batch, query_chunks, k] (out-of-range indices are clipped).
    scale: the score scale.
    config: tiles and launch parameters; None means `default_triton_config()` with the
      stages fitted to the shared-memory budget (`config_for`).
    interpret: run the kernels in Pallas interpret mode; None means on CPU.

  Returns:
    [batch, seq, heads, head_dim] in q's dtype. Products take q's dtype (float32 inputs:
    full float32 products; bf16/f16: bf16/f16 products with float32 accumulation).

  Raises:
    ValueError: sizes or a dtype the kernels do not take, or a config whose tiles exceed
      the shared-memory budget (`unsupported_reason`).
  """
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  _, seq, heads, head_dim = q.shape
  chunk_len, kv_heads = chunk_k.shape[2:4]
  query_chunks = chunk_indices.shape[1]
  query_len = seq // query_chunks
  reason = unsupported_reason(
    head_dim=head_dim,
    chunk_len=chunk_len,
    heads=heads,
    kv_heads=kv_heads,
    dtype=q.dtype,
    config=config,
    query_len=query_len,
  )
  if reason:
    raise ValueError(reason)
  config, tiling = config_for(
    config, query_len=query_len, group=heads // kv_heads, chunk_len=chunk_len, head_dim=head_dim, dtype=q.dtype
  )
  padded = padding.pad(
    q,
    chunk_k,
    chunk_v,
    chunk_weights,
    chunk_indices,
    query_rows=tiling.padded_query_len,
    chunk_tile=tiling.padded_chunk_len,
  )
  return padded.unpad(_gca(*padded.arrays, tiling, float(scale), config, interpret))
