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
from castle_jax.ops.power.expansion import expand, expanded_dim, validate_expansion

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


def causal_power_bases(scores: jax.Array, p: int, cumulative_log_g: jax.Array | None) -> jax.Array:
  """r_ij = scores_ij * exp((G_i - G_j) / p) for j <= i, exactly 0 above the diagonal: w_ij = r_ij^p.

  Args:
    scores: [B, H_kv, group, T, T], scale * q_i . k_j.
    p: the even power.
    cumulative_log_g: [B, T, H_kv], G (inclusive cumsum of log-gates), or None.

  Returns:
    [B, H_kv, group, T, T].
  """
  seq = scores.shape[-1]
  causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
  if cumulative_log_g is not None:
    g = jnp.moveaxis(cumulative_log_g, 1, -1)[:, :, None, :]  # [B, H_kv, 1, T]
    # Above the diagonal G_i - G_j >= 0 can overflow exp; select before exponentiating.
    scores = scores * jnp.exp(jnp.where(causal, (g[..., :, None] - g[..., None, :]) / p, -jnp.inf))
  return jnp.where(causal, scores, 0.0)


def attend(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  cumulative_log_g: jax.Array | None,
  p: int,
  state: PowerState | None = None,
  *,
  expansion: str = "spow",
  d_tile: int | None = None,
  precision=None,
) -> jax.Array:
  """Outputs of queries over the keys at the same positions (causal) and a state of earlier tokens.

  y_i = [e^{G_i} phi(q_i) S + sum_{j<=i} w_ij v_j] / [e^{G_i} phi(q_i) . z + sum_{j<=i} w_ij],
  w_ij = (q_i . k_j)^p exp(G_i - G_j): the attention form (state None), one chunk of the
  chunked form, or one token of the recurrent form. A query whose terms are all zero
  outputs 0 instead of 0/0.

  Each query is divided by a constant (not differentiated) that makes its largest term
  +-1 before the power, the row max of the paper's attention kernel (Appendix F.1,
  Table 5): every term has degree p in q_i, so the output does not change, and neither
  do its gradients, but the sum that normalizes is at least 1. Unscaled, a query nearly
  orthogonal to the keys it sees had a tiny sum (with p = 4 the first token's single
  term (scale q_0 . k_0)^4 is below 5.4e-20 once |scale q_0 . k_0| < 1.5e-5), autodiff
  of the division formed N / D^2 with D^2 = 0 in float32, and the gradient turned
  inf/NaN while the output was fine. The terms are divided by their sum before they
  weigh the values, and the largest term is exactly 1, so a term that carries all the
  weight gives exactly its value and exactly zero gradient: the gradient w.r.t. a score,
  p w_ij (v_j - y_i) / (s_ij sum_j w_ij), would amplify any rounding of y_i by 1 / s_ij.

  Args:
    q: [B, c, H_kv, group, d], already multiplied by the score scale.
    k: [B, c, H_kv, d]; v: [B, c, H_kv, d_v].
    cumulative_log_g: [B, c, H_kv], G_i (inclusive, counted from the state's last token), or None.
    p: the even power.
    state: the PowerState (S [B, H_kv, D, d_v], z [B, H_kv, D]) of the tokens before, or None.
    expansion, d_tile: the phi the state was built with.
    precision: of the products.

  Returns:
    [B, c, H_kv, group, d_v].
  """
  scores = jnp.einsum("bihgd,bjhd->bhgij", q, k, precision=precision)
  bases = causal_power_bases(scores, p, cumulative_log_g)
  row_max = jax.lax.stop_gradient(jnp.max(jnp.abs(bases), axis=-1))  # [B, H_kv, group, c]
  divisor = jnp.where(row_max > 0, row_max, 1.0)
  scaled = bases / divisor[..., None]
  # XLA may divide by multiplying with a reciprocal, one rounding off: the largest term is
  # set to exactly +-1, keeping the division's gradient.
  top = (jnp.abs(bases) == row_max[..., None]) & (row_max > 0)[..., None]
  bases = jnp.where(top, scaled + jax.lax.stop_gradient(jnp.sign(bases) - scaled), scaled)
  state_weight = 0.0
  if state is not None:
    # The same division for the state's terms: phi(q / m) = phi(q) / m^p.
    phi_q = expand(q / jnp.moveaxis(divisor, -1, 1)[..., None], p, expansion, d_tile)
    if cumulative_log_g is not None:
      phi_q = phi_q * jnp.exp(cumulative_log_g)[..., None, None]
    state_weight = jnp.einsum("bihgD,bhD->bihg", phi_q, state.normalizer, precision=precision)
    # Where the state outweighs the largest term in the block (or the block has none),
    # every term is divided by the state's sum instead.
    empty = jnp.moveaxis(row_max == 0, -1, 1)
    outweighs = (state_weight > 1.0) | (empty & (state_weight > 0.0))
    extra = jax.lax.stop_gradient(jnp.where(outweighs, state_weight, 1.0))  # [B, c, H_kv, group]
    bases = bases / jnp.moveaxis(extra, 1, -1)[..., None] ** (1.0 / p)
    phi_q = phi_q / extra[..., None]
    state_weight = state_weight / extra
  weights = bases**p
  denominator = state_weight + jnp.moveaxis(jnp.sum(weights, axis=-1), -1, 1)  # [B, c, H_kv, group]
  zero = denominator == 0
  safe = jnp.where(zero, 1.0, denominator)
  out = jnp.einsum("bhgij,bjhe->bihge", weights / jnp.moveaxis(safe, 1, -1)[..., None], v, precision=precision)
  if state is not None:
    out = out + jnp.einsum("bihgD,bhDe->bihge", phi_q / safe[..., None], state.state, precision=precision)
  return jnp.where(zero[..., None], 0.0, out)


def normalize(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
  """numerator / denominator[..., None], with 0 where the denominator is exactly 0.

  A zero denominator means every weight is zero (a zero query, or the padding of
  the chunked form); the definition's 0/0 would be NaN and poison gradients.
  """
  zero = denominator == 0
  safe = jnp.where(zero, 1.0, denominator)
  return jnp.where(zero[..., None], 0.0, numerator / safe[..., None])
