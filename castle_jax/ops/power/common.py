"""Pieces of the power-attention math shared by the reference, chunked and recurrent paths.

Notation (paper Sec. 4, with the authors' gating convention), per head, 0-based
positions, G_i = sum_{l <= i} log g_l (inclusive cumulative log-gate):
  weight   w_ij = (scale * q_i . k_j)^p * exp(G_i - G_j),   j <= i,
  output   y_i = sum_j w_ij v_j / sum_j w_ij.
With an expansion phi (phi(a) . phi(b) = (a . b)^p) this is gated linear attention
with the state after token t
  S_t = sum_{j <= t} exp(G_t - G_j) phi(k_j) v_j^T   [D, d_v],
  z_t = sum_{j <= t} exp(G_t - G_j) phi(k_j)         [D]  (the normalizer),
and y_t = phi(scale q_t) S_t / phi(scale q_t) . z_t. A state handed in from earlier
tokens (S_0, z_0) enters as exp(G_i) phi(scale q_i) S_0 (resp. z_0).

Grouped-query heads: q has H_q = group * H_kv heads; q head h reads k/v head
h // group, and log_g (one gate per k/v head) discounts that head's state.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import score_scale
from castle_jax.ops.power.expansion import expanded_dim, validate_expansion

DEFAULT_CHUNK_SIZE = 128


class PowerState(NamedTuple):
  """The recurrent state of power attention after some tokens (S_t, z_t above).

  Attributes:
    state: [batch, kv_heads, D, value_dim], sum of discounted phi(k_j) v_j^T.
    normalizer: [batch, kv_heads, D], sum of discounted phi(k_j).
  Kept in float32 (float64 for float64 inputs) whatever the inputs' dtype.
  """

  state: jax.Array
  normalizer: jax.Array


def validate_power(p) -> int:
  if isinstance(p, bool) or not isinstance(p, numbers.Integral):
    raise ValueError(f"p must be an even int >= 2, got {p!r}")
  if p < 2 or p % 2:
    raise ValueError(
      f"p must be an even int >= 2, got {p}: odd powers give negative weights, and power attention "
      "normalizes by the sum of the weights, which needs them positive (paper Sec. 6)"
    )
  return int(p)


def resolve_scale(scale, head_dim: int) -> float:
  """The score scale: 1/sqrt(head_dim) by default (the authors' convention), else a float > 0."""
  if scale is None:
    return score_scale(head_dim)
  if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < float(scale) < float("inf"):
    raise ValueError(f"scale must be None (1/sqrt(head_dim)) or a finite float > 0, got {scale!r}")
  return float(scale)


def validate_chunk_size(chunk_size) -> int:
  """chunk_size as an int >= 1 (the default for None is `castle_jax.ops.power.resolve`'s to decide)."""
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
    raise ValueError(f"chunk_size must be None (the implementation's default) or an int >= 1, got {chunk_size!r}")
  return int(chunk_size)


def validate_inputs(q: jax.Array, k: jax.Array, v: jax.Array, log_g: jax.Array | None) -> None:
  """Checks shapes and dtypes of q [B, T, H_q, d], k [B, T, H_kv, d], v [B, T, H_kv, d_v],
  log_g [B, T, H_kv] (or None).

  Raises:
    ValueError naming the offending argument.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(
        f"{name} must have shape [batch, seq, heads, head_dim] (rank 4); got shape {getattr(x, 'shape', type(x))}"
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be floating point, got dtype {x.dtype}")
  for name, x in (("k", k), ("v", v)):
    if x.dtype != q.dtype:
      raise ValueError(f"{name} has dtype {x.dtype} but q has dtype {q.dtype}; cast q, k and v to one dtype")
  batch, seq, heads, head_dim = q.shape
  if min(q.shape) < 1 or min(v.shape) < 1:
    raise ValueError(f"q and v must have non-empty axes; got q {q.shape}, v {v.shape}")
  if k.shape[:2] != (batch, seq) or v.shape[:2] != (batch, seq):
    raise ValueError(f"q {q.shape}, k {k.shape} and v {v.shape} must agree in batch and seq (axes 0 and 1)")
  if k.shape[3] != head_dim:
    raise ValueError(f"k has head_dim {k.shape[3]} but q has {head_dim}; queries and keys need one head_dim")
  if v.shape[2] != k.shape[2]:
    raise ValueError(f"v has {v.shape[2]} heads but k has {k.shape[2]}; k and v need the same heads")
  if heads % k.shape[2]:
    raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({k.shape[2]}) for grouped-query attention")
  if log_g is not None:
    expected = (batch, seq, k.shape[2])
    if getattr(log_g, "shape", None) != expected:
      raise ValueError(
        f"log_g must have shape [batch, seq, kv_heads] = {expected} (one gate per k/v head); "
        f"got {getattr(log_g, 'shape', type(log_g))}"
      )
    if not jnp.issubdtype(log_g.dtype, jnp.floating):
      raise ValueError(f"log_g must be floating point, got dtype {log_g.dtype}")


def validate_state(
  initial_state: PowerState | None, k: jax.Array, v: jax.Array, p: int, expansion: str, d_tile: int | None
) -> None:
  """Checks that a state matches the inputs and the expansion."""
  if initial_state is None:
    return
  if not isinstance(initial_state, PowerState):
    raise ValueError(f"initial_state must be a PowerState(state, normalizer), got {type(initial_state).__name__}")
  batch, _, kv_heads, head_dim = k.shape
  dim = expanded_dim(head_dim, p, expansion, d_tile)
  expected = {"state": (batch, kv_heads, dim, v.shape[3]), "normalizer": (batch, kv_heads, dim)}
  for name, shape in expected.items():
    actual = getattr(initial_state, name).shape
    if actual != shape:
      raise ValueError(
        f"initial_state.{name} has shape {actual}, expected {shape} = [batch, kv_heads, D"
        f"{', value_dim' if name == 'state' else ''}] with D = {dim} for p={p}, expansion={expansion!r}"
      )


def validate_all(q, k, v, log_g, p, scale, expansion, d_tile, initial_state=None):
  """Every check of the public entry points; returns (p, scale, d_tile) resolved."""
  validate_inputs(q, k, v, log_g)
  p = validate_power(p)
  scale = resolve_scale(scale, q.shape[-1])
  d_tile = validate_expansion(expansion, q.shape[-1], p, d_tile)
  validate_state(initial_state, k, v, p, expansion, d_tile)
  return p, scale, d_tile


def group_queries(q: jax.Array, kv_heads: int) -> jax.Array:
  """[B, T, H_q, d] -> [B, T, H_kv, group, d]: q head h reads k/v head h // group."""
  batch, seq, heads, head_dim = q.shape
  return q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)


def causal_power_weights(scores: jax.Array, p: int, cumulative_log_g: jax.Array | None) -> jax.Array:
  """w_ij = scores_ij^p * exp(G_i - G_j) for j <= i, exactly 0 above the diagonal.

  Args:
    scores: [B, H_kv, group, T, T], scale * q_i . k_j.
    p: the even power.
    cumulative_log_g: [B, T, H_kv], G (inclusive cumsum of log-gates), or None.

  Returns:
    [B, H_kv, group, T, T].
  """
  seq = scores.shape[-1]
  causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
  weights = scores**p
  if cumulative_log_g is not None:
    g = jnp.moveaxis(cumulative_log_g, 1, -1)[:, :, None, :]  # [B, H_kv, 1, T]
    # Above the diagonal G_i - G_j >= 0 can overflow exp; select before exponentiating.
    decay = jnp.exp(jnp.where(causal, g[..., :, None] - g[..., None, :], -jnp.inf))
    weights = weights * decay
  return jnp.where(causal, weights, 0.0)


def normalize(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """numerator / denominator[..., None], with 0 where the denominator is exactly 0.

  A zero denominator means every weight is zero (a zero query, or the padding of
  the chunked form); the definition's 0/0 would be NaN and poison gradients.
  """
  zero = denominator == 0
  safe = jnp.where(zero, 1.0, denominator)
  return jnp.where(zero[..., None], 0.0, numerator / safe[..., None])
