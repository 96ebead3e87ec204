"""Power attention as an RNN: one-token decoding with a constant-size state, and prefill.

The state after token t (see `common`) is updated and queried per token:
  S_t = g_t S_{t-1} + phi(k_t) v_t^T,   z_t = g_t z_{t-1} + phi(k_t),
  y_t = phi(scale q_t) S_t / phi(scale q_t) . z_t,
where the token's own term phi(q_t) . phi(k_t) is computed as (scale q_t . k_t)^p.
Its size, kv_heads * D * (value_dim + 1) numbers, does not depend on how many tokens
were seen: decoding costs O(D d_v) per token and head at any context length, which is
what makes power attention worth having. A prompt fills the state in the chunked
form (`prefill`); any number of tokens can follow.

`PowerCache` is the explicit pytree the model's decoding loop carries.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from castle_jax.ops.backend import Implementation, choose, rejects_renamed_arguments
from castle_jax.ops.power.api import power_attention
from castle_jax.ops.power.xla import empty_state
from castle_jax.ops.numerics import math_dtype
from castle_jax.ops.power.common import (
  PowerState,
  attend,
  group_queries,
  validate_all,
)
from castle_jax.ops.power.expansion import expand


@flax.struct.dataclass
class PowerCache:
  """The decoding state of one power-attention layer.

  Attributes:
    state: [batch, kv_heads, D, value_dim], sum of discounted phi(k_j) v_j^T (float32).
    normalizer: [batch, kv_heads, D], sum of discounted phi(k_j) (float32).
    length: int32 scalar, the number of tokens absorbed (the same for every sequence).
  """

  state: jax.Array
  normalizer: jax.Array
  length: jax.Array

  @property
  def power_state(self) -> PowerState:
    return PowerState(self.state, self.normalizer)

  def advanced(self, new_state: PowerState, tokens: int) -> "PowerCache":
    return PowerCache(
      new_state.state.astype(self.state.dtype), new_state.normalizer.astype(self.normalizer.dtype), self.length + tokens
    )


def init_cache(
  batch: int,
  kv_heads: int,
  head_dim: int,
  value_dim: int | None = None,
  *,
  p: int = 2,
  expansion: str = "spow",
  d_tile: int | None = None,
  dtype=jnp.float32,
) -> PowerCache:
  """An empty cache: zero state and normalizer, length 0. Its size is independent of any capacity."""
  state = empty_state(
    batch, kv_heads, head_dim, value_dim or head_dim, p=p, expansion=expansion, d_tile=d_tile, dtype=dtype
  )
  return PowerCache(state.state, state.normalizer, jnp.zeros((), jnp.int32))


def _token_step(carry: PowerState, token, *, p: int, expansion: str, d_tile: int | None):
  """Absorbs one token and returns its output.

  The earlier tokens are read through the state, the token's own weight (q_t . k_t)^p
  directly, as the chunked form does inside a chunk: phi(q) . phi(k) sums D signed terms
  that can dwarf (q . k)^p, and a token whose own key carries most of its weight (the
  first token, or after strong forgetting) would otherwise lose its digits to that
  cancellation.

  Args:
    carry: PowerState ([B, H_kv, D, d_v], [B, H_kv, D]) after the earlier tokens.
    token: q [B, H_kv, group, d] (already scaled), k [B, H_kv, d], v [B, H_kv, d_v],
      log_g [B, H_kv].

  Returns:
    (the state including this token, output [B, H_kv, group, d_v]).
  """
  q, k, v, log_g = token
  # One position of the chunked form's block: own term (q . k)^p, state discounted by g_t.
  out = attend(q[:, None], k[:, None], v[:, None], log_g[:, None], p, carry, expansion=expansion, d_tile=d_tile)
  gate = jnp.exp(log_g)[..., None]  # [B, H_kv, 1]: discounts the earlier tokens
  phi_k = expand(k, p, expansion, d_tile)
  state = gate[..., None] * carry.state + phi_k[..., :, None] * v[..., None, :]
  normalizer = gate * carry.normalizer + phi_k
  return PowerState(state, normalizer), out[:, 0]


def power_attention_recurrent(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  scale: float | None = None,
  expansion: str = "spow",
  d_tile: int | None = None,
  initial_state: PowerState | None = None,
) -> tuple[jax.Array, PowerState]:
  """Causal power attention one token at a time (a `lax.scan` of the recurrence).

  Args:
    q: [batch, seq, heads, head_dim]; k: [batch, seq, kv_heads, head_dim];
    v: [batch, seq, kv_heads, value_dim]; log_g: [batch, seq, kv_heads] or None.
    p, scale, expansion, d_tile: as in `power_attention_chunked`.
    initial_state: PowerState of earlier tokens, or None.

  Returns:
    outputs [batch, seq, heads, value_dim] in q's dtype and the final PowerState
    in the compute dtype.
  """
  p, scale, d_tile = validate_all(q, k, v, log_g, p, scale, expansion, d_tile, initial_state)
  return _recurrent_form(q, k, v, log_g, initial_state, p=p, scale=scale, expansion=expansion, d_tile=d_tile)


# Compiled as one program even when called eagerly; inlined under an outer jit.
@functools.partial(jax.jit, static_argnames=("p", "scale", "expansion", "d_tile"))
def _recurrent_form(q, k, v, log_g, initial_state, *, p, scale, expansion, d_tile):
  batch, seq, heads, head_dim = q.shape
  kv_heads, value_dim = k.shape[2], v.shape[3]
  dtype = math_dtype(q.dtype)
  if log_g is None:
    log_g = jnp.zeros((batch, seq, kv_heads), dtype)
  if initial_state is None:
    initial_state = empty_state(
      batch, kv_heads, head_dim, value_dim, p=p, expansion=expansion, d_tile=d_tile, dtype=dtype
    )
  initial_state = PowerState(*(x.astype(dtype) for x in initial_state))
  tokens = (group_queries(q.astype(dtype) * scale, kv_heads), k.astype(dtype), v.astype(dtype), log_g.astype(dtype))
  step = functools.partial(_token_step, p=p, expansion=expansion, d_tile=d_tile)
  final_state, outputs = jax.lax.scan(step, initial_state, tuple(jnp.moveaxis(x, 1, 0) for x in tokens))
  outputs = jnp.moveaxis(outputs, 0, 1).reshape(batch, seq, heads, value_dim)
  return outputs.astype(q.dtype), final_state


# The recurrent step is the only decoding step: a memory-bound O(D d_v) update per head
# with no Pallas kernel of its own ("reference" is the same step).
_DECODE_IMPLEMENTATIONS = {"reference": Implementation(), "xla": Implementation()}


def decode_step(
  cache: PowerCache,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  scale: float | None = None,
  expansion: str = "spow",
  d_tile: int | None = None,
  implementation: str | None = None,
) -> tuple[jax.Array, PowerCache]:
  """One new token: O(D d_v) per head whatever the length.

  Args:
    cache: the PowerCache after `length` tokens.
    q: [batch, 1, heads, head_dim]; k: [batch, 1, kv_heads, head_dim];
    v: [batch, 1, kv_heads, value_dim]; log_g: [batch, 1, kv_heads] or None.
    implementation: "xla" or "reference" (both the recurrent step), or None ("xla").

  Returns:
    output [batch, 1, heads, value_dim] in q's dtype, and the cache with length + 1.
  """
  if q.ndim == 4 and q.shape[1] != 1:
    raise ValueError(
      f"decode_step takes one token (q of shape [batch, 1, heads, head_dim]); got {q.shape}. "
      "Use prefill or append_tokens for several"
    )
  choose("power decode_step", implementation, _DECODE_IMPLEMENTATIONS, ("xla",))
  outputs, state = power_attention_recurrent(
    q, k, v, log_g, p=p, scale=scale, expansion=expansion, d_tile=d_tile, initial_state=cache.power_state
  )
  return outputs, cache.advanced(state, 1)


@rejects_renamed_arguments
def prefill(
  cache: PowerCache,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  scale: float | None = None,
  chunk_size: int | None = None,
  expansion: str = "spow",
  d_tile: int | None = None,
  implementation: str | None = None,
  kernel_config=None,
) -> tuple[jax.Array, PowerCache]:
  """Absorbs a block of tokens starting from the cache's state, through `power_attention`.

  Args:
    cache: the PowerCache after `length` tokens (empty for a prompt).
    q, k, v, log_g: [batch, new, ...] as in `power_attention`.
    chunk_size, implementation, kernel_config: as in `power_attention` (the same choice
      as training: `castle_jax.ops.power.resolve`).

  Returns:
    outputs [batch, new, heads, value_dim] in q's dtype, and the cache with length + new.
  """
  outputs, state = power_attention(
    q,
    k,
    v,
    log_g,
    p=p,
    scale=scale,
    chunk_size=chunk_size,
    expansion=expansion,
    d_tile=d_tile,
    initial_state=cache.power_state,
    return_final_state=True,
    implementation=implementation,
    kernel_config=kernel_config,
  )
  return outputs, cache.advanced(state, q.shape[1])


@rejects_renamed_arguments
def append_tokens(
  cache: PowerCache,
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  scale: float | None = None,
  chunk_size: int | None = None,
  expansion: str = "spow",
  d_tile: int | None = None,
  implementation: str | None = None,
  kernel_config=None,
) -> tuple[jax.Array, PowerCache]:
  """Any number of new tokens on any cache: one token takes `decode_step`, more take `prefill`.

  The choice depends only on the (static) number of new tokens; both give the rows of
  the attention form for these positions. `implementation` and `kernel_config` choose
  the prefill's path as `power_attention` does; a single token always takes the
  recurrent step (there is no other decoding step).
  """
  options = dict(p=p, scale=scale, expansion=expansion, d_tile=d_tile)
  validate_all(q, k, v, log_g, p, scale, expansion, d_tile, cache.power_state)
  if q.shape[1] == 1:
    return decode_step(cache, q, k, v, log_g, **options)
  return prefill(
    cache, q, k, v, log_g, chunk_size=chunk_size, implementation=implementation, kernel_config=kernel_config, **options
  )
