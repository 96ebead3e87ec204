"""A fixed-capacity key/value cache: an explicit pytree, so it works under jit,
can be sharded, and can live in host memory."""

from __future__ import annotations

import flax.struct
import numpy as np
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class KVCache:
  """Keys and values of the tokens seen so far.

  Attributes:
    keys, values: [batch, capacity, kv_heads, head_dim]; slots >= length are empty.
    length: int32 scalar, number of filled slots (the same for every sequence); or int32
      [batch], each row's own (`per_row`: rows that accept different numbers of drafted
      tokens in speculative decoding).
  """

  keys: jax.Array
  values: jax.Array
  length: jax.Array

  @classmethod
  def create(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "KVCache":
    shape = (batch, capacity, kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

  @property
  def capacity(self) -> int:
    return self.keys.shape[1]

  def per_row(self) -> "KVCache":
    """The same cache with one length per row (int32 [batch]), so rows can grow apart."""
    return self.replace(length=jnp.broadcast_to(jnp.asarray(self.length, jnp.int32), (self.keys.shape[0],)))

  def append(self, keys: jax.Array, values: jax.Array, count: jax.Array | int | None = None) -> "KVCache":
    """Writes [batch, new, kv_heads, head_dim] keys/values after the filled slots.

    count: how many of the `new` entries become filled (default all; may be traced):
    speculative decoding writes a fixed-size padded path and keeps its accepted prefix.
    With one length, the slots written past `count` stay empty and are overwritten by the
    next append. With per-row lengths, count is a scalar or int32 [batch] and each row's
    entries past its count are not written at all, so a row with count 0 may sit at the
    end of the cache.

    Raises ValueError when `new` exceeds the capacity, or, when the length is a
    concrete value (outside jit), when the filled slots plus `new` would.
    Under jit the caller checks the budget up front (see `generate`): every `new`
    slot must fit, or the write would be shifted over filled ones.
    """
    _check_rows(keys, self.keys.shape[0], "KV cache")
    new = keys.shape[1]
    if new > self.capacity:
      raise ValueError(f"cannot append {new} tokens to a KV cache of capacity {self.capacity}")
    if jnp.ndim(self.length):
      return self._append_per_row(keys, values, count)
    if not isinstance(self.length, jax.core.Tracer) and int(self.length) + new > self.capacity:
      raise ValueError(
        f"KV cache overflow: {int(self.length)} filled + {new} new > capacity {self.capacity}; "
        "create the cache with a larger capacity"
      )
    start = (0, self.length, 0, 0)
    return KVCache(
      jax.lax.dynamic_update_slice(self.keys, keys.astype(self.keys.dtype), start),
      jax.lax.dynamic_update_slice(self.values, values.astype(self.values.dtype), start),
      self.length + (new if count is None else jnp.asarray(count, jnp.int32)),
    )

  def _append_per_row(self, keys: jax.Array, values: jax.Array, count) -> "KVCache":
    batch, new = keys.shape[:2]
    count = jnp.broadcast_to(jnp.asarray(new if count is None else count, jnp.int32), (batch,))
    if not isinstance(self.length, jax.core.Tracer) and not isinstance(count, jax.core.Tracer):
      needed = np.asarray(self.length) + np.asarray(count)
      if (needed > self.capacity).any():
        raise ValueError(
          f"KV cache overflow: rows need {needed.tolist()} slots > capacity {self.capacity}; "
          "create the cache with a larger capacity"
        )
    offsets = jnp.arange(new, dtype=jnp.int32)
    # Entries past a row's count go to slot `capacity`, which the scatter drops.
    slots = jnp.where(offsets < count[:, None], self.length[:, None] + offsets, self.capacity)
    rows = jnp.arange(batch)[:, None]
    return KVCache(
      self.keys.at[rows, slots].set(keys.astype(self.keys.dtype), mode="drop"),
      self.values.at[rows, slots].set(values.astype(self.values.dtype), mode="drop"),
      self.length + count,
    )

  def key_positions(self) -> jax.Array:
    """int32 [batch, capacity]: the position of each slot, -1 for empty slots."""
    slots = jnp.arange(self.capacity, dtype=jnp.int32)
    positions = jnp.where(slots < jnp.asarray(self.length)[..., None], slots, -1)
    return jnp.broadcast_to(positions, (self.keys.shape[0], self.capacity))


def _check_rows(keys: jax.Array, batch: int, what: str) -> None:
  if keys.shape[0] != batch:
    raise ValueError(
      f"cannot append a batch of {keys.shape[0]} rows to a {what} built for batch {batch}; "
      f"create the cache with batch={keys.shape[0]}"
    )


@flax.struct.dataclass
class WindowKVCache:
  """Keys and values of the last `capacity` positions, in a ring: the memory of a
  sliding-window layer stays constant however long the sequence grows.

  Decoding attends new queries to every filled slot under the positional mask
  (`causal_mask` with the window), so a layer with window W that appends up to n
  positions at a time needs capacity >= W + n - 1: then no slot a new query may see is
  overwritten by the same append.

  Attributes:
    keys, values: [batch, capacity, kv_heads, head_dim].
    positions: int32 [capacity], the position held by each slot, -1 for empty slots; or
      [batch, capacity] with per-row lengths (`per_row`).
    length: int32 scalar, positions appended so far (the next one's position); or int32
      [batch], each row's own.
  """

  keys: jax.Array
  values: jax.Array
  positions: jax.Array
  length: jax.Array

  @classmethod
  def create(cls, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> "WindowKVCache":
    if capacity < 1:
      raise ValueError(f"WindowKVCache capacity must be >= 1, got {capacity}")
    shape = (batch, capacity, kv_heads, head_dim)
    return cls(
      jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.full((capacity,), -1, jnp.int32), jnp.zeros((), jnp.int32)
    )

  @property
  def capacity(self) -> int:
    return self.keys.shape[1]

  def per_row(self) -> "WindowKVCache":
    """The same ring with one length per row (rows can grow apart)."""
    batch = self.keys.shape[0]
    return self.replace(
      positions=jnp.broadcast_to(self.positions, (batch, self.capacity)),
      length=jnp.broadcast_to(jnp.asarray(self.length, jnp.int32), (batch,)),
    )

  def append(self, keys: jax.Array, values: jax.Array, count: jax.Array | int | None = None) -> "WindowKVCache":
    """Writes [batch, new, kv_heads, head_dim] keys/values over the oldest slots (new <= capacity).

    count: how many of the `new` entries are real (default all; may be traced). With one
    length, the slots written for the rest are marked empty, so the ring must hold `new`
    more slots than the positions it has to keep. With per-row lengths, count is a scalar
    or int32 [batch] and each row's entries past its count are not written.
    """
    _check_rows(keys, self.keys.shape[0], "window KV cache")
    new = keys.shape[1]
    if new > self.capacity:
      raise ValueError(f"cannot append {new} positions to a window KV cache of capacity {self.capacity}")
    offsets = jnp.arange(new, dtype=jnp.int32)
    if jnp.ndim(self.length):
      batch = keys.shape[0]
      count = jnp.broadcast_to(jnp.asarray(new if count is None else count, jnp.int32), (batch,))
      positions = self.length[:, None] + offsets
      # Entries past a row's count go to slot `capacity`, which the scatters drop.
      slots = jnp.where(offsets < count[:, None], positions % self.capacity, self.capacity)
      rows = jnp.arange(batch)[:, None]
      return WindowKVCache(
        self.keys.at[rows, slots].set(keys.astype(self.keys.dtype), mode="drop"),
        self.values.at[rows, slots].set(values.astype(self.values.dtype), mode="drop"),
        self.positions.at[rows, slots].set(positions, mode="drop"),
        self.length + count,
      )
    positions = self.length + offsets
    slots = positions % self.capacity
    count = new if count is None else jnp.asarray(count, jnp.int32)
    return WindowKVCache(
      self.keys.at[:, slots].set(keys.astype(self.keys.dtype)),
      self.values.at[:, slots].set(values.astype(self.values.dtype)),
      self.positions.at[slots].set(jnp.where(offsets < count, positions, -1)),
      self.length + count,
    )

  def key_positions(self) -> jax.Array:
    """int32 [batch, capacity]: the position of each slot, -1 for empty slots."""
    return jnp.broadcast_to(self.positions, (self.keys.shape[0], self.capacity))
