"""CASTLE decoding with the UQ-KV cache (Sec. 2.4, Appendix E, Algorithms 4 and 5).

The cache is an explicit pytree of fixed capacity, so `prefill` and `decode_step` run
under `jax.jit` and the cache can be sharded or kept in host memory.

Decoding token t (0-based; `length` = t tokens are cached):
  1. rank-1 update (Eq. 12): u_s += sigmoid(q^U_s . k^U_t / sqrt(d)) v^U_t for every
     cached s whose lookahead mask admits t (s < t, and t <= s + W under SWL);
  2. append q^U_t, k^C_t, v^C_t and the empty lookahead key u_t^t = 0;
  3. combine (Eqs. 4-7) with the causal query q^C_t.

CASTLE-SWL: u_s stops changing once t > s + W, so step 1 touches only the W rows
s = t-W .. t-1, and only those lookahead queries are ever read again. The queries are
kept in a ring buffer of min(W, capacity) rows (position s in row s mod rows), while
U, K^C and V^C keep every position because the combining step scores all of them.

Capacity: writing past it is an error. `prefill` checks the prompt length
statically (ValueError). `decode_step` raises ValueError when the cache length is
concrete (eager use); under `jax.jit` the length is traced, so the step
  - registers a `checkify.debug_check`, which becomes an error when the caller wraps
    the step with `jax.experimental.checkify.checkify`,
  - and otherwise returns a NaN output and the cache unchanged, never overwriting a
    slot, so overflow cannot pass unnoticed as plausible numbers.
"""

from __future__ import annotations

import functools
import numbers

import flax.struct
import jax
from jax.experimental import checkify
import jax.numpy as jnp
import numpy as np

from castle_jax.ops.backend import Implementation, choose, rejects_renamed_arguments
from castle_jax.ops.castle.api import implementations
from castle_jax.ops.castle.xla import DEFAULT_BLOCK_SIZE, castle_blockwise_prefill
from castle_jax.ops.numerics import math_dtype, score_scale
from castle_jax.ops.castle.common import (
  attend_with_lookahead_keys,
  lookahead_visible,
  masked_sigmoid,
  validate_inputs,
  validate_window,
)
from castle_jax.sharding import SEQUENCE_HEADS_AXES, TOKEN_HEADS_AXES, map_over_shards
from pallas_kernels.castle import CastleDecodeConfig, castle_forward_mosaic, castle_prefill_triton
from pallas_kernels.castle import triton_decode
from pallas_kernels.castle import triton as triton_ops

# The prefill's default stays on the Triton forward: the Mosaic one runs when asked for
# (implementation="mosaic"); only forward plus backward was measured for the default.
PREFILL_DEFAULT_ORDER = ("triton", "xla")
# Decoding has one kernel, Triton's (one token: nothing for wgmma tiles to fill); a model
# that trains with "mosaic" decodes with it too.
DECODE_DEFAULT_ORDER = ("triton", "xla")


@flax.struct.dataclass
class UQKVCache:
  """The UQ-KV cache of one CASTLE layer.

  Attributes:
    lookahead_keys: U, [batch, capacity, heads, head_dim]; row s holds u_s^t for
      s < length, rows >= length are zero.
    lookahead_queries: Q^U, [batch, query_rows, heads, head_dim]. CASTLE:
      query_rows = capacity, row s holds q^U_s. CASTLE-SWL: a ring buffer of
      query_rows = min(window, capacity) rows, position s lives in row s % query_rows.
    causal_keys, causal_values: K^C, V^C, [batch, capacity, heads, head_dim].
    length: int32 scalar, the number of cached tokens (the same for every sequence).
    window: None for CASTLE, W for CASTLE-SWL (static).
  """

  lookahead_keys: jax.Array
  lookahead_queries: jax.Array
  causal_keys: jax.Array
  causal_values: jax.Array
  length: jax.Array
  window: int | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def capacity(self) -> int:
    return self.causal_keys.shape[1]

  @property
  def query_rows(self) -> int:
    return self.lookahead_queries.shape[1]


def _query_rows(capacity: int, window: int | None) -> int:
  return capacity if window is None else min(window, capacity)


def init_cache(
  batch: int,
  capacity: int,
  heads: int,
  head_dim: int,
  dtype,
  window: int | None = None,
) -> UQKVCache:
  """An empty UQ-KV cache.

  Args:
    batch, capacity, heads, head_dim: cache shape; capacity is the most tokens
      (prompt plus generated) it can hold.
    dtype: storage dtype (e.g. jnp.bfloat16 as in the paper); the math runs in >= float32.
    window: None for CASTLE, W >= 1 for CASTLE-SWL.

  Returns:
    A UQKVCache with length 0.
  """
  for name, value in (("batch", batch), ("capacity", capacity), ("heads", heads), ("head_dim", head_dim)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
      raise ValueError(f"{name} must be an int >= 1, got {value!r}")
  validate_window(window)
  full = jnp.zeros((batch, capacity, heads, head_dim), dtype)
  queries = jnp.zeros((batch, _query_rows(capacity, window), heads, head_dim), dtype)
  return UQKVCache(full, queries, full, full, jnp.zeros((), jnp.int32), window)


def _check_against_cache(cache: UQKVCache, inputs, what: str) -> None:
  validate_inputs(inputs, cache.window)
  batch, _, heads, head_dim = inputs[0].shape
  cache_batch, _, cache_heads, cache_head_dim = cache.causal_keys.shape
  expected = (cache_batch, cache_heads, cache_head_dim)
  if (batch, heads, head_dim) != expected:
    raise ValueError(
      f"{what}: q_u has shape {inputs[0].shape}, but the cache holds batch, heads, "
      f"head_dim = {expected}; create the cache with init_cache(batch, capacity, heads, "
      "head_dim, ...) matching the inputs"
    )


@rejects_renamed_arguments
def prefill(
  cache: UQKVCache,
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  block_size: int = DEFAULT_BLOCK_SIZE,
  implementation: str | None = None,
  kernel_config=None,
) -> tuple[jax.Array, UQKVCache]:
  """Algorithm 5: the prompt's outputs and a cache filled with its UQ-KV state.

  Starts a new sequence: whatever `cache` held is replaced; only its capacity, dtype
  and window are used. The outputs equal the parallel form (they come from the
  blockwise forward, Algorithm 1); U^L comes from the same pass.

  Args:
    cache: an UQKVCache (e.g. from `init_cache`).
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, prompt_len, heads, head_dim].
    block_size: block size of the blockwise forward ("xla").
    implementation: the forward pass that yields outputs and U^L: "xla" (blockwise
      Algorithm 1), "triton" or "mosaic" (the forward kernels, whose final D is U^L),
      "reference" (treated as "xla": the parallel form has no U^L), or None ("triton"
      on a GPU where it runs, else "xla"; `PREFILL_DEFAULT_ORDER`).
    kernel_config: a `CastleTritonConfig` for "triton", a `CastleMosaicConfig` for
      "mosaic", or None (their defaults).

  Returns:
    outputs: [batch, prompt_len, heads, head_dim] in the inputs' dtype.
    cache: the cache with length = prompt_len.

  Raises:
    ValueError: prompt_len > capacity, or shapes that do not match the cache.
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  _check_against_cache(cache, inputs, "prefill")
  prompt_len = q_u.shape[1]
  if prompt_len > cache.capacity:
    raise ValueError(
      f"prefill: the prompt has {prompt_len} tokens but the cache capacity is {cache.capacity}; "
      "create the cache with a larger capacity"
    )
  table = implementations(q_u.dtype, q_u.shape[-1], cache.window)
  implementation = choose("prefill", implementation, table, PREFILL_DEFAULT_ORDER, kernel_config=kernel_config)
  if implementation in ("triton", "mosaic"):
    run = functools.partial(
      _prefill_triton if implementation == "triton" else _prefill_mosaic,
      scale=score_scale(q_u.shape[-1]),
      window=cache.window,
      config=kernel_config,
      interpret=jax.default_backend() == "cpu",
    )
    outputs, keys = map_over_shards(run, inputs, [SEQUENCE_HEADS_AXES] * 6, [SEQUENCE_HEADS_AXES] * 2, what="prefill")
  else:
    outputs, keys = castle_blockwise_prefill(*inputs, window=cache.window, block_size=block_size)

  def fill(buffer, values, rows):
    return buffer.at[:, rows].set(values.astype(buffer.dtype))

  prompt_rows = np.arange(prompt_len)
  # Only the last query_rows lookahead queries are ever read again.
  kept = np.arange(max(0, prompt_len - cache.query_rows), prompt_len)
  empty = jnp.zeros_like(cache.lookahead_keys)
  new_cache = UQKVCache(
    lookahead_keys=fill(empty, keys, prompt_rows),
    lookahead_queries=fill(jnp.zeros_like(cache.lookahead_queries), q_u[:, kept], kept % cache.query_rows),
    causal_keys=fill(empty, k_c, prompt_rows),
    causal_values=fill(empty, v_c, prompt_rows),
    length=jnp.asarray(prompt_len, jnp.int32),
    window=cache.window,
  )
  return outputs, new_cache


def _prefill_triton(*inputs, scale, window, config, interpret):
  return castle_prefill_triton(*inputs, scale=scale, window=window, config=config, interpret=interpret)


def _prefill_mosaic(*inputs, scale, window, config, interpret):
  """The Mosaic forward's outputs and final D (the prompt's lookahead keys U^L)."""
  result = castle_forward_mosaic(*inputs, scale=scale, window=window, config=config, interpret=interpret)
  return result.out, result.lookahead_keys


def _overflow_message(capacity: int) -> str:
  return (
    f"UQ-KV cache overflow: decode_step on a full cache (capacity {capacity}); create the cache with a larger capacity"
  )


def _write_row(buffer: jax.Array, values: jax.Array, row: jax.Array, in_bounds: jax.Array) -> jax.Array:
  """buffer[:, row] = values, or unchanged when not in_bounds (row is clamped into the
  buffer, so an overflowing step rewrites a cached row with its own value)."""
  row = jnp.minimum(row, buffer.shape[1] - 1)
  old = jax.lax.dynamic_slice_in_dim(buffer, row, 1, axis=1)
  values = jnp.where(in_bounds, values.astype(buffer.dtype), old)
  return jax.lax.dynamic_update_slice_in_dim(buffer, values, row, axis=1)


def _update_lookahead_keys(cache: UQKVCache, position, in_bounds, k_u, v_u, dtype) -> jax.Array:
  """Eq. (12) in XLA: u_s += sigmoid(q^U_s . k^U_t / sqrt(d)) v^U_t for the rows whose
  mask admits t (all s < t for CASTLE, the last W for SWL; the slice has query_rows rows).

  Returns the cache's lookahead keys with those rows updated (unchanged if not in_bounds).
  """
  capacity, query_rows = cache.capacity, cache.query_rows
  start = jnp.clip(position - query_rows, 0, capacity - query_rows)
  updated_positions = start + jnp.arange(query_rows)
  queries = jnp.take(cache.lookahead_queries, updated_positions % query_rows, axis=1).astype(dtype)
  logits = jnp.einsum("bshd,bhd->bhs", queries, k_u[:, 0]) * score_scale(k_u.shape[-1])
  visible = lookahead_visible(updated_positions, position[None], cache.window)[:, 0] & in_bounds
  weights = masked_sigmoid(logits, visible)
  keys = jax.lax.dynamic_slice_in_dim(cache.lookahead_keys, start, query_rows, axis=1).astype(dtype)
  keys = keys + jnp.einsum("bhs,bhd->bshd", weights, v_u[:, 0])
  return jax.lax.dynamic_update_slice_in_dim(
    cache.lookahead_keys, keys.astype(cache.lookahead_keys.dtype), start, axis=1
  )


def _decode_implementation(implementation: str | None, cache: UQKVCache, dtype, kernel_config) -> str:
  """ "triton" or "xla" for a decoding step: "mosaic" runs the Triton decoding kernel and
  "reference" (no step of its own) the XLA step; the default falls back to "xla" (logged)
  where the kernel cannot run."""
  head_dim = cache.causal_keys.shape[-1]

  def kernel_unsupported() -> str | None:
    if not triton_decode.supports_head_dim(head_dim):
      return f"the decoding kernel takes power-of-two head dims >= 16, got {head_dim}; use implementation='xla'"
    return triton_ops.unsupported_reason(dtype)

  kernel = Implementation(kernel_unsupported, default_backends=("gpu",), config_type=CastleDecodeConfig)
  table = {"reference": Implementation(), "xla": Implementation(), "triton": kernel, "mosaic": kernel}
  chosen = choose("decode_step", implementation, table, DECODE_DEFAULT_ORDER, kernel_config=kernel_config)
  return "triton" if chosen in ("triton", "mosaic") else "xla"


@rejects_renamed_arguments
def decode_step(
  cache: UQKVCache,
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  implementation: str | None = None,
  kernel_config: CastleDecodeConfig | None = None,
) -> tuple[jax.Array, UQKVCache]:
  """Algorithm 4: one new token against the UQ-KV cache.

  Args:
    cache: the UQKVCache after `length` tokens.
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, 1, heads, head_dim], the new token's
      projections.
    implementation: "xla" (rank-1 update and combining step as XLA ops), "triton"
      (`pallas_kernels.castle.triton_decode`: one kernel updates U and attends in a single
      pass; SWL updates its W rows in XLA first; power-of-two head dims), "mosaic" (the
      same Triton kernel), "reference" (as "xla"), or None ("triton" on a GPU where it
      applies, else "xla").
    kernel_config: a `CastleDecodeConfig` for the decoding kernel (None: its default).

  Returns:
    output: [batch, 1, heads, head_dim] in the inputs' dtype.
    cache: the cache with the token appended (length + 1).

  Raises:
    ValueError: wrong shapes, or a full cache while the length is concrete. Under jit
      see the module docstring (checkify / NaN output).
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  _check_against_cache(cache, inputs, "decode_step")
  if q_u.shape[1] != 1:
    raise ValueError(f"decode_step takes one token: q_u must have seq = 1, got shape {q_u.shape}")
  capacity, query_rows = cache.capacity, cache.query_rows
  if not isinstance(cache.length, jax.core.Tracer) and int(cache.length) >= capacity:
    raise ValueError(_overflow_message(capacity))
  position = jnp.asarray(cache.length, jnp.int32)
  in_bounds = position < capacity
  checkify.debug_check(in_bounds, _overflow_message(capacity))

  dtype = math_dtype(jnp.promote_types(q_u.dtype, cache.lookahead_keys.dtype))
  implementation = _decode_implementation(implementation, cache, dtype, kernel_config)
  # CASTLE's update touches every cached row: the kernel fuses it with attending.
  fused_update = implementation == "triton" and cache.window is None
  lookahead_keys = cache.lookahead_keys
  if not fused_update:
    lookahead_keys = _update_lookahead_keys(cache, position, in_bounds, k_u.astype(dtype), v_u.astype(dtype), dtype)
  # Append the token; it has no successors yet: u_t^t = 0. Every write is one row, so an
  # overflowing step (not in_bounds) costs nothing and changes nothing.
  new_cache = UQKVCache(
    lookahead_keys=_write_row(lookahead_keys, jnp.zeros_like(k_u), position, in_bounds),
    lookahead_queries=_write_row(cache.lookahead_queries, q_u, position % query_rows, in_bounds),
    causal_keys=_write_row(cache.causal_keys, k_c, position, in_bounds),
    causal_values=_write_row(cache.causal_values, v_c, position, in_bounds),
    length=jnp.where(in_bounds, position + 1, position),
    window=cache.window,
  )

  if implementation == "triton":
    last_row = jnp.minimum(position, capacity - 1)
    attend = functools.partial(
      triton_decode.decode_attend,
      scale=score_scale(q_c.shape[-1]),
      update_lookahead_keys=fused_update,
      config=kernel_config,
      interpret=jax.default_backend() == "cpu",
    )
    output, keys = map_over_shards(
      attend,
      (
        q_c[:, 0],
        k_u[:, 0],
        v_u[:, 0],
        new_cache.lookahead_queries if fused_update else new_cache.causal_keys,
        new_cache.causal_keys,
        new_cache.causal_values,
        new_cache.lookahead_keys,
        last_row,
        jnp.where(in_bounds, position, 0),
      ),
      [TOKEN_HEADS_AXES] * 3 + [SEQUENCE_HEADS_AXES] * 4 + [None, None],
      [TOKEN_HEADS_AXES, SEQUENCE_HEADS_AXES],
      what="decode_step",
    )
    new_cache = new_cache.replace(lookahead_keys=keys)
    output = output[:, None]
  else:
    # Combining step (Eqs. 4-7), scored with the causal query q^C_t.
    cached = jnp.arange(capacity) <= position
    # Empty slots get zero weight, but 0 * garbage is not 0 when the garbage is NaN/inf.
    values = jnp.where(cached[None, :, None, None], new_cache.causal_values.astype(dtype), 0.0)
    output = attend_with_lookahead_keys(
      q_c.astype(dtype),
      new_cache.causal_keys.astype(dtype),
      values,
      new_cache.lookahead_keys.astype(dtype),
      cached[None, :],
    )
  output = jnp.where(in_bounds, output, jnp.nan).astype(inputs[0].dtype)
  return output, new_cache


@rejects_renamed_arguments
def append_tokens(
  cache: UQKVCache,
  q_u: jax.Array,
  k_u: jax.Array,
  v_u: jax.Array,
  q_c: jax.Array,
  k_c: jax.Array,
  v_c: jax.Array,
  *,
  block_size: int = DEFAULT_BLOCK_SIZE,
  implementation: str | None = None,
  kernel_config=None,
  decode_kernel_config: CastleDecodeConfig | None = None,
) -> tuple[jax.Array, UQKVCache]:
  """Appends any number of tokens: a prefill into an empty cache, decoding steps otherwise.

  The outputs equal the parallel form's rows for these positions whatever the cache
  held, so a prompt can be fed in pieces. An empty cache takes the blockwise prefill
  (Algorithm 5); a non-empty one runs Algorithm 4 once per token (a `lax.scan`). Under
  jit both branches are compiled and `lax.cond` picks one by the traced length.

  Args:
    cache: the UQKVCache after `length` tokens.
    q_u, k_u, v_u, q_c, k_c, v_c: [batch, new, heads, head_dim], the new tokens'
      projections (positions length .. length + new - 1).
    block_size: of the prefill (see `prefill`).
    implementation: of the prefill and the decoding steps (see `prefill`, `decode_step`).
    kernel_config, decode_kernel_config: kernel configs of the prefill (see `prefill`) and
      of the decoding step (a `CastleDecodeConfig`); None: their defaults.

  Returns:
    outputs: [batch, new, heads, head_dim] in the inputs' dtype.
    cache: the cache with length + new tokens.

  Raises:
    ValueError: new > capacity or shapes that do not match the cache; a cache that
      would overflow while the length is concrete (under jit: NaN outputs, as
      `decode_step`).
  """
  inputs = (q_u, k_u, v_u, q_c, k_c, v_c)
  if q_u.ndim == 4 and q_u.shape[1] == 1:
    return decode_step(cache, *inputs, implementation=implementation, kernel_config=decode_kernel_config)
  _check_against_cache(cache, inputs, "append_tokens")
  new = q_u.shape[1]
  if new > cache.capacity:
    raise ValueError(
      f"append_tokens: {new} tokens do not fit a cache of capacity {cache.capacity}; "
      "create the cache with a larger capacity"
    )

  def fresh(cache):
    return prefill(cache, *inputs, block_size=block_size, implementation=implementation, kernel_config=kernel_config)

  def extend(cache):
    def step(cache, token):
      output, cache = decode_step(
        cache, *(x[:, None] for x in token), implementation=implementation, kernel_config=decode_kernel_config
      )
      return cache, output[:, 0]

    cache, outputs = jax.lax.scan(step, cache, tuple(jnp.moveaxis(x, 1, 0) for x in inputs))
    return jnp.moveaxis(outputs, 0, 1), cache

  if not isinstance(cache.length, jax.core.Tracer):
    length = int(cache.length)
    if length + new > cache.capacity:
      raise ValueError(
        f"UQ-KV cache overflow: {length} cached + {new} new tokens > capacity {cache.capacity}; "
        "create the cache with a larger capacity"
      )
    return fresh(cache) if length == 0 else extend(cache)
  return jax.lax.cond(cache.length == 0, fresh, extend, cache)
