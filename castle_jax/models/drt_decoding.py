"""DRT decoding with the chunk memory in host RAM (GCA paper, Sec. 3.2).

A `DRTStream` takes the tokens of a sequence in any number of `feed` calls (a long
prompt at once, then one token at a time) and returns the logits the teacher-forced
forward pass (`DRT.__call__`) gives at the same positions. What it keeps:

  on the device, constant in the context length except the landmarks:
    every layer's sliding-window keys/values (`WindowKVCache`, a ring of W + piece
    positions), the current chunk's last-lower-layer states, each group's retrieved
    memory for the current chunk (k chunks), and the encoder landmark of every completed
    chunk ([batch, chunks, d_model]: O(L d / S), what retrieval scores against);
  in host memory: each completed chunk's keys and values ([batch, chunks, S, kv_heads,
    head_dim] each: O(L d)), copied off the device as the chunk completes (asynchronously,
    through the `pinned_host` memory kind where the backend has it) and brought back only
    for the k chunks a group retrieves.

The tokens are processed in pieces that never straddle a retrieval decision the piece
itself needs: the head of a partly filled chunk, whole chunks (`segment_chunks` at a
time), the rest. A piece runs in G + 1 jitted stages: the lower layers and the chunk
encoder (+ group 0's retrieval), then each group's upper layers (+ the next group's
retrieval); between stages the host gathers the retrieved chunks. As in training, chunk
t's retrieval (made from its landmark state) serves chunk t + 1, and retrieval uses no
noise (the random retriever draws from its position-keyed evaluation key, so it picks the
chunks the forward pass picks; `castle_jax.models.drt.select`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.layers.embedding import lm_head, token_embedding
from castle_jax.models.drt import DRT, ChunkMemory, DRTBlock, norm, retrieval_scale, select
from castle_jax.ops.attention import WindowKVCache
from castle_jax.ops.gca import retrieval_scores

HOST_MEMORY_KIND = "pinned_host"


class HostChunkMemory:
  """Keys and values of completed chunks, held in host RAM.

  `write` starts the device-to-host copy at once (into `pinned_host` memory when the
  device has it, so the copy overlaps the compute queued after it) and `gather` waits for
  it only when a retrieval needs the chunks.

  Args:
    batch, max_chunks: rows and chunks it can hold.
    chunk_shape: (S, kv_heads, head_dim).
    dtype: the keys' and values' dtype.
  """

  def __init__(self, batch: int, max_chunks: int, chunk_shape: tuple[int, int, int], dtype):
    shape = (batch, max_chunks, *chunk_shape)
    # np.empty reserves address space; pages are touched only as chunks arrive.
    self.keys = np.empty(shape, np.dtype(dtype))
    self.values = np.empty(shape, np.dtype(dtype))
    self.filled = 0
    self._pending: list[tuple[int, jax.Array, jax.Array]] = []

  @property
  def max_chunks(self) -> int:
    return self.keys.shape[1]

  @property
  def nbytes(self) -> int:
    """Host bytes of the chunks written so far."""
    return 2 * self.filled * int(np.prod(self.keys.shape[2:])) * self.keys.shape[0] * self.keys.itemsize

  def write(self, start: int, keys: jax.Array, values: jax.Array) -> None:
    """Stores chunks start .. start + m - 1: keys/values [batch, m, S, kv_heads, head_dim]."""
    count = keys.shape[1]
    if start != self.filled or start + count > self.max_chunks:
      raise ValueError(
        f"chunks {start}..{start + count - 1} do not follow the {self.filled} stored chunks "
        f"within the capacity of {self.max_chunks}"
      )
    self._pending.append((start, to_host(keys), to_host(values)))
    self.filled += count

  def gather(self, indices: np.ndarray, device: jax.Device) -> tuple[jax.Array, jax.Array]:
    """indices int [batch, n, k] -> keys, values [batch, n, k, S, kv_heads, head_dim] on `device`."""
    for start, keys, values in self._pending:
      stop = start + keys.shape[1]
      self.keys[:, start:stop] = np.asarray(keys)
      self.values[:, start:stop] = np.asarray(values)
    self._pending.clear()
    rows = np.arange(indices.shape[0])[:, None, None]
    return (jax.device_put(self.keys[rows, indices], device), jax.device_put(self.values[rows, indices], device))


def to_host(x: jax.Array) -> jax.Array:
  """Starts copying x to host memory (`pinned_host`), or returns x where the device has no such memory."""
  device = next(iter(x.devices()))
  if HOST_MEMORY_KIND not in [memory.kind for memory in device.addressable_memories()]:
    return x
  return jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind=HOST_MEMORY_KIND))


@flax.struct.dataclass
class DRTState:
  """What a DRTStream keeps on the device (shapes with G groups, k = top_k, S = chunk size).

  Attributes:
    caches: one `WindowKVCache` per decoder layer.
    chunk_buffer: [batch, S + 1, d_model], the current chunk's last-lower-layer states.
    landmarks: [batch, max_chunks, d_model], the encoder landmark of each completed chunk.
    served_keys, served_values: [G, batch, k, S, kv_heads, head_dim], the chunks each
      group retrieved for the current chunk.
    served_weights: float32 [G, batch, k], their weights (0: empty slot, e.g. in chunk 0).
  """

  caches: tuple[WindowKVCache, ...]
  chunk_buffer: jax.Array
  landmarks: jax.Array
  served_keys: jax.Array
  served_values: jax.Array
  served_weights: jax.Array


def piece_layout(offset: int, count: int, chunk_size: int) -> tuple[bool, ...]:
  """Which positions of a piece are landmarks: `count` tokens starting `offset` tokens into
  a chunk, a landmark after each token that ends a chunk."""
  layout = []
  for i in range(count):
    layout.append(False)
    if (offset + i) % chunk_size == chunk_size - 1:
      layout.append(True)
  return tuple(layout)


class DRTStream:
  """Incremental DRT decoding over one batch of sequences (see the module docstring).

  Args:
    model: a `DRT` module.
    params: its parameters (unboxed).
    batch: sequences decoded together.
    capacity: the most tokens per sequence (sizes the landmark store and host memory).
    segment_chunks: whole chunks per piece when feeding long prompts (larger: fewer
      host round trips, more device memory for one piece's activations).
  """

  def __init__(self, model: DRT, params: Any, batch: int, capacity: int, *, segment_chunks: int = 16):
    if not isinstance(model, DRT):
      raise ValueError(f"model must be a DRT module, got {type(model).__name__}")
    if batch < 1 or capacity < 1 or segment_chunks < 1:
      raise ValueError(f"batch ({batch}), capacity ({capacity}) and segment_chunks ({segment_chunks}) must be >= 1")
    cfg, opt = model.config, model.options
    self.model, self.params, self.batch = model, params, batch
    self.size = opt.chunk_size
    self.segment_chunks = segment_chunks
    self.capacity = capacity
    self.seen = 0
    self.device = next(iter(jax.tree.leaves(params)[0].devices()))
    max_chunks = max(opt.top_k, capacity // self.size)
    # The longest piece is one segment: the ring must hold W positions besides it.
    ring = cfg.sliding_window + segment_chunks * (self.size + 1)
    top_k, groups = opt.top_k, opt.retrieval_groups
    memory_shape = (self.size, cfg.kv_heads, cfg.qk_head_dim)
    dtype = cfg.compute_dtype
    self.memory = HostChunkMemory(batch, max_chunks, memory_shape, dtype)
    served = jnp.zeros((groups, batch, top_k, *memory_shape), dtype)
    self.state = jax.device_put(
      DRTState(
        caches=tuple(
          WindowKVCache.create(batch, ring, cfg.kv_heads, cfg.qk_head_dim, dtype) for _ in range(cfg.n_layers)
        ),
        chunk_buffer=jnp.zeros((batch, self.size + 1, cfg.d_model), dtype),
        landmarks=jnp.zeros((batch, max_chunks, cfg.d_model), dtype),
        served_keys=served,
        served_values=served,
        served_weights=jnp.zeros((groups, batch, top_k), jnp.float32),
      ),
      self.device,
    )

  @property
  def device_state_bytes(self) -> int:
    """Bytes of the device state (window caches, landmarks, served chunks)."""
    return sum(x.nbytes for x in jax.tree.leaves(self.state))

  def feed(self, tokens: jax.Array | np.ndarray, keep: int = 1) -> jax.Array:
    """Appends tokens int [batch, n] to every sequence.

    Returns:
      float32 [batch, keep, vocab]: the logits at the last `keep` of these tokens
      (logits[:, i] predicts the token after the i-th of them).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[0] != self.batch or tokens.shape[1] < 1:
      raise ValueError(f"tokens must be int [batch={self.batch}, n >= 1], got shape {tokens.shape}")
    if not 1 <= keep <= tokens.shape[1]:
      raise ValueError(f"keep must be in [1, {tokens.shape[1]}] (the tokens fed), got {keep}")
    if self.seen + tokens.shape[1] > self.capacity:
      raise ValueError(
        f"{self.seen} tokens seen + {tokens.shape[1]} new exceed the stream's capacity "
        f"({self.capacity}); create the DRTStream with a larger capacity"
      )
    hidden = []
    kept = 0
    for piece in self._pieces(tokens.shape[1]):
      piece_hidden = self._run_piece(tokens[:, piece])
      if tokens.shape[1] - piece.stop < keep:
        hidden.append(piece_hidden)
        kept += piece_hidden.shape[1]
    hidden = jnp.concatenate(hidden, axis=1)[:, kept - keep :]
    return _logits(self.model, self.params, hidden)

  def _pieces(self, count: int) -> list[slice]:
    """Slices of the new tokens: the rest of the current chunk, whole-chunk segments, the rest."""
    bounds = [0]
    head = -self.seen % self.size
    if head:
      bounds.append(min(head, count))
    while count - bounds[-1] >= self.size:
      bounds.append(bounds[-1] + min(self.segment_chunks, (count - bounds[-1]) // self.size) * self.size)
    if bounds[-1] < count:
      bounds.append(count)
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

  def _run_piece(self, tokens: np.ndarray) -> jax.Array:
    """Runs one piece through the model; returns its final hidden states [batch, n, d_model]."""
    offset, completed = self.seen % self.size, self.seen // self.size
    layout = piece_layout(offset, tokens.shape[1], self.size)
    new_chunks = sum(layout)
    start = self.seen + completed  # landmark-layout position of the piece's first token
    scalars = jnp.asarray([start, offset, completed], jnp.int32)
    x, state, memory_k, memory_v, retrieval = _lower_stage(
      self.model, layout, self.params, self.state, jnp.asarray(tokens, jnp.int32), scalars
    )
    if new_chunks:
      self.memory.write(completed, memory_k, memory_v)
    for group in range(self.model.options.retrieval_groups):
      served = self._served_memory(state, group, retrieval)
      x, state, retrieval = _upper_stage(self.model, layout, group, self.params, state, x, scalars, served)
    self.state = state
    self.seen += tokens.shape[1]
    return x

  def _served_memory(self, state: DRTState, group: int, retrieval):
    """The memory each chunk the piece touches reads: the group's current chunks, then the
    chunks retrieved at each chunk the piece completes (brought from host memory); the
    last retrieval becomes the group's current chunks."""
    current = (
      state.served_keys[group][:, None],
      state.served_values[group][:, None],
      state.served_weights[group][:, None],
    )
    if retrieval is None:
      return current
    indices, weights = retrieval
    keys, values = self.memory.gather(np.asarray(indices), self.device)
    return tuple(jnp.concatenate([a, b], axis=1) for a, b in zip(current, (keys, values, weights)))


def _apply(module, params, *args, **kwargs):
  return module.apply({"params": params}, *args, **kwargs)


def _window_positions(scalars: jax.Array, count: int, batch: int) -> jax.Array:
  return jnp.broadcast_to(scalars[0] + jnp.arange(count, dtype=jnp.int32), (batch, count))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _lower_stage(model: DRT, layout: tuple[bool, ...], params, state: DRTState, tokens: jax.Array, scalars: jax.Array):
  """Embedding, lower layers, the chunk encoder of the chunks the piece completes, and
  group 0's retrieval at them. scalars: int32 [3] = (first layout position, offset into
  the current chunk, chunks completed before the piece)."""
  cfg, opt = model.config, model.options
  size, batch = opt.chunk_size, tokens.shape[0]
  is_landmark = np.array(layout)
  token_slot = np.cumsum(~is_landmark) - 1
  embedded = _apply(token_embedding(cfg), params["embed"], tokens)[:, np.maximum(token_slot, 0)]
  x = jnp.where(is_landmark[None, :, None], params["landmark"].astype(embedded.dtype), embedded)
  positions = _window_positions(scalars, len(layout), batch)
  caches = list(state.caches)
  for layer in range(cfg.n_layers // 2):
    x, caches[layer] = _apply(DRTBlock(cfg), params[f"block_{layer}"], x, positions=positions, cache=caches[layer])

  # The current chunk's states so far, then this piece's: whole chunks first, then the new current chunk.
  extended = jnp.concatenate([state.chunk_buffer, jnp.zeros((batch, len(layout), cfg.d_model), x.dtype)], axis=1)
  extended = jax.lax.dynamic_update_slice(extended, x.astype(extended.dtype), (0, scalars[1], 0))
  new_chunks = int(is_landmark.sum())
  whole = new_chunks * (size + 1)
  state = state.replace(caches=tuple(caches), chunk_buffer=extended[:, whole : whole + size + 1])
  if not new_chunks:
    return x, state, None, None, None
  chunks = extended[:, :whole].reshape(batch, new_chunks, size + 1, cfg.d_model)
  landmarks, memory_k, memory_v = _apply(ChunkMemory(cfg, opt), params["chunk_memory"], chunks)
  state = state.replace(
    landmarks=jax.lax.dynamic_update_slice(state.landmarks, landmarks.astype(state.landmarks.dtype), (0, scalars[2], 0))
  )
  return x, state, memory_k, memory_v, _retrieve(model, layout, 0, params, state, x, scalars)


def _retrieve(
  model: DRT, layout: tuple[bool, ...], group: int, params, state: DRTState, x: jax.Array, scalars: jax.Array
):
  """Group `group`'s retrieval at each landmark of the piece: (indices, weights) [batch, m, k]."""
  cfg, opt = model.config, model.options
  at_landmarks = x[:, np.flatnonzero(np.array(layout))]
  queries = _apply(norm(cfg), params[f"retrieval_norm_{group}"], at_landmarks)
  chunk_ids = scalars[2] + jnp.arange(queries.shape[1], dtype=jnp.int32)
  scores = retrieval_scores(queries, state.landmarks, scale=retrieval_scale(cfg), query_chunks=chunk_ids)
  return select(opt, scores, opt.top_k, None, group=group, query_chunks=chunk_ids)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _upper_stage(
  model: DRT, layout: tuple[bool, ...], group: int, params, state: DRTState, x: jax.Array, scalars: jax.Array, served
):
  """Group `group`'s upper layers over the piece, reading `served` = (keys, values
  [batch, n, k, S, kv_heads, head_dim], weights [batch, n, k]) for the n chunks the piece
  touches (and the chunks retrieved at its last landmark, kept for the next piece). After
  the last group: the final norm at the token positions."""
  cfg, opt = model.config, model.options
  keys, values, weights = served
  batch, top_k = x.shape[0], opt.top_k
  is_landmark = np.array(layout)
  touched = _touched_chunks(layout)
  chunk_slots = keys.shape[1]
  memory = (
    keys[:, :touched].reshape(batch, touched * top_k, *keys.shape[3:]),
    values[:, :touched].reshape(batch, touched * top_k, *values.shape[3:]),
    weights[:, :touched],
    jnp.broadcast_to(jnp.arange(touched * top_k, dtype=jnp.int32).reshape(touched, top_k), (batch, touched, top_k)),
  )
  positions = _window_positions(scalars, len(layout), batch)
  caches = list(state.caches)
  groups = opt.upper_layer_groups(cfg.n_layers)
  first = cfg.n_layers // 2 + sum(groups[:group])
  for layer in range(first, first + groups[group]):
    x, caches[layer] = _apply(
      DRTBlock(cfg, cross_attention=True, gca_output=opt.gca_output),
      params[f"block_{layer}"],
      x,
      memory,
      positions=positions,
      cache=caches[layer],
      query_offset=scalars[1],
    )
  state = state.replace(caches=tuple(caches))
  if chunk_slots > 1:  # the piece completed chunks: the last retrieval serves the next chunk
    state = state.replace(
      served_keys=state.served_keys.at[group].set(keys[:, -1]),
      served_values=state.served_values.at[group].set(values[:, -1]),
      served_weights=state.served_weights.at[group].set(weights[:, -1]),
    )
  if group + 1 < opt.retrieval_groups:
    retrieval = _retrieve(model, layout, group + 1, params, state, x, scalars) if is_landmark.any() else None
    return x, state, retrieval
  hidden = _apply(norm(cfg), params["final_norm"], x[:, np.flatnonzero(~is_landmark)])
  return hidden, state, None


def _touched_chunks(layout: tuple[bool, ...]) -> int:
  """Chunks a piece has positions in: one per landmark, plus a trailing partial chunk."""
  landmarks = sum(layout)
  return landmarks + (0 if layout[-1] else 1)


@functools.partial(jax.jit, static_argnums=0)
def _logits(model: DRT, params, hidden: jax.Array) -> jax.Array:
  cfg = model.config
  if cfg.tie_embeddings:
    logits = _apply(token_embedding(cfg), params["embed"], hidden, method="attend")
  else:
    logits = _apply(lm_head(cfg), params["lm_head"], hidden)
  return logits.astype(jnp.float32)


def last_logits(model: DRT, params: Any, tokens: jax.Array, count: int, *, segment_chunks: int = 64) -> jax.Array:
  """The teacher-forced logits of the last `count` tokens of tokens int [batch, L], streamed
  (device memory does not grow with L beyond the landmarks): float32 [batch, count, vocab]."""
  stream = DRTStream(model, params, tokens.shape[0], tokens.shape[1], segment_chunks=segment_chunks)
  return stream.feed(tokens, keep=count)


def stream_decoder(model: DRT, params: Any, batch: int, capacity: int) -> DRTStream:
  """The model family's streaming decoder (used by `castle_jax.inference.generate`)."""
  return DRTStream(model, params, batch, capacity)
