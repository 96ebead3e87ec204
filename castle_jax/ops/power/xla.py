"""Chunked power attention in XLA (paper Sec. 2 "Chunked form", Sec. 4.1, Appendices A and F).

The sequence is cut into n chunks of c tokens (the last one padded). Per chunk, with
G the inclusive cumulative log-gate *within* the chunk and G_c its last entry:

  query state + intra-chunk attention, combined and normalized (Eq. 38):
    y_i = [e^{G_i} phi(q_i) S + sum_{j<=i in chunk} w_ij v_j] / [e^{G_i} phi(q_i) . z + sum_j w_ij]
  update state (Eq. 34/35), discounted with the chunk's gate total (discumsum, Eq. 36):
    S <- e^{G_c} S + sum_j e^{G_c - G_j} phi(k_j) v_j^T,   z <- e^{G_c} z + sum_j e^{G_c - G_j} phi(k_j)

where S, z enter as the state after all earlier chunks (or `initial_state`), and
q is pre-multiplied by `scale`. Every factor e^{...} has a non-positive exponent, so
nothing overflows however long the sequence; the states are float32 (float64 for
float64 inputs) and stay unscaled (the authors' kernels keep bf16 states divided
by sqrt(D); a float32 state overflows only once T * |scale q . k|^p nears 3e38). The
outputs are combined with a per-query row max, as in the authors' kernels: each query's
terms are divided by the largest of them (`common.attend`), so the normalizing sum is
at least 1 and its gradient stays finite however small the terms are.

A `lax.scan` walks the chunks, carrying (S, z): phi(K) and phi(Q) are expanded one
chunk at a time ([c, D] per head), never for the whole sequence. The step is wrapped
in `jax.checkpoint`, so the backward pass stores only each chunk's incoming state
(n * D * (d_v + 1) numbers per head) besides the inputs, and re-expands phi in the
backward sweep. Memory: O(T d + (T / c) D d_v) per head, plus O(c^2 + c D) scratch.

Padding: zero keys (phi(0) = 0) and zero log-gates (no discount) change neither the
outputs of real tokens nor the final state, so T need not be a multiple of c; a
chunk size above T is the same as c = T (one chunk: the attention form).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import math_dtype
from castle_jax.ops.power.common import (
  DEFAULT_CHUNK_SIZE,
  PowerState,
  attend,
  group_queries,
  validate_all,
  validate_chunk_size,
)
from castle_jax.ops.power.expansion import expand, expanded_dim


def empty_state(
  batch: int,
  kv_heads: int,
  head_dim: int,
  value_dim: int,
  *,
  p: int = 2,
  expansion: str = "spow",
  d_tile: int | None = None,
  dtype=jnp.float32,
) -> PowerState:
  """The zero state (no tokens seen): state [B, H_kv, D, value_dim], normalizer [B, H_kv, D]."""
  dim = expanded_dim(head_dim, p, expansion, d_tile)
  return PowerState(jnp.zeros((batch, kv_heads, dim, value_dim), dtype), jnp.zeros((batch, kv_heads, dim), dtype))


def _chunk_step(carry: PowerState, chunk, *, p: int, expansion: str, d_tile: int | None):
  """One chunk: outputs from the incoming state + intra-chunk attention, then the state update.

  Args:
    carry: the state after all earlier chunks ([B, H_kv, D, d_v], [B, H_kv, D]).
    chunk: q [B, c, H_kv, group, d] (already scaled), k [B, c, H_kv, d],
      v [B, c, H_kv, d_v], log_g [B, c, H_kv].

  Returns:
    (the state after this chunk, outputs [B, c, H_kv, group, d_v]).
  """
  q, k, v, log_g = chunk
  cumulative = jnp.cumsum(log_g, axis=1)  # [B, c, H_kv]
  total = cumulative[:, -1]  # [B, H_kv]

  outputs = attend(q, k, v, cumulative, p, carry, expansion=expansion, d_tile=d_tile)

  phi_k = expand(k, p, expansion, d_tile) * jnp.exp(total[:, None] - cumulative)[..., None]
  decay = jnp.exp(total)
  state = decay[..., None, None] * carry.state + jnp.einsum("bjhD,bjhe->bhDe", phi_k, v)
  normalizer = decay[..., None] * carry.normalizer + jnp.sum(phi_k, axis=1)
  return PowerState(state, normalizer), outputs


def power_attention_chunked(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  scale: float | None = None,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  expansion: str = "spow",
  d_tile: int | None = None,
  initial_state: PowerState | None = None,
) -> tuple[jax.Array, PowerState]:
  """Causal power attention in the chunked form; equals `power_attention_reference`.

  Args:
    q: [batch, seq, heads, head_dim].
    k: [batch, seq, kv_heads, head_dim]; heads is a multiple of kv_heads.
    v: [batch, seq, kv_heads, value_dim].
    log_g: [batch, seq, kv_heads] log-gates, or None (no gating).
    p: even power >= 2.
    scale: score scale; None means 1/sqrt(head_dim).
    chunk_size: tokens per chunk (static); any size >= 1, seq need not be a multiple.
    expansion: "spow" (default), "tpow" or "tspow" (same outputs, different D).
    d_tile: tile size for "tspow".
    initial_state: the state after earlier tokens (e.g. a prompt), or None for zeros.

  Returns:
    outputs [batch, seq, heads, value_dim] in q's dtype, and the final PowerState
    (state [batch, kv_heads, D, value_dim], normalizer [batch, kv_heads, D]) in the
    compute dtype (float32 for bf16/float32 inputs).
  """
  p, scale, d_tile = validate_all(q, k, v, log_g, p, scale, expansion, d_tile, initial_state)
  chunk_size = validate_chunk_size(chunk_size)
  return _chunked_form(
    q,
    k,
    v,
    log_g,
    initial_state,
    p=p,
    scale=scale,
    chunk=min(chunk_size, q.shape[1]),
    expansion=expansion,
    d_tile=d_tile,
  )


# Compiled as one program even when called eagerly (e.g. Flax init); inlined under an outer jit.
@functools.partial(jax.jit, static_argnames=("p", "scale", "chunk", "expansion", "d_tile"))
def _chunked_form(q, k, v, log_g, initial_state, *, p, scale, chunk, expansion, d_tile):
  batch, seq, heads, head_dim = q.shape
  kv_heads, value_dim = k.shape[2], v.shape[3]
  dtype = math_dtype(q.dtype)
  num_chunks = -(-seq // chunk)
  padding = num_chunks * chunk - seq

  def to_chunks(x):
    """[B, T, ...] -> [n, B, c, ...], zero-padded at the end of the sequence."""
    x = jnp.pad(x.astype(dtype), [(0, 0), (0, padding)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(batch, num_chunks, chunk, *x.shape[2:]), 1, 0)

  if log_g is None:
    log_g = jnp.zeros((batch, seq, kv_heads), dtype)
  chunks = (to_chunks(group_queries(q.astype(dtype) * scale, kv_heads)), to_chunks(k), to_chunks(v), to_chunks(log_g))
  if initial_state is None:
    initial_state = empty_state(
      batch, kv_heads, head_dim, value_dim, p=p, expansion=expansion, d_tile=d_tile, dtype=dtype
    )
  else:
    initial_state = PowerState(*(x.astype(dtype) for x in initial_state))
  step = jax.checkpoint(functools.partial(_chunk_step, p=p, expansion=expansion, d_tile=d_tile), prevent_cse=False)
  final_state, outputs = jax.lax.scan(step, initial_state, chunks)
  outputs = jnp.moveaxis(outputs, 0, 1).reshape(batch, num_chunks * chunk, heads, value_dim)
  return outputs[:, :seq].astype(q.dtype), final_state
