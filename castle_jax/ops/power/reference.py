"""Power-attention oracles: the attention form from its definition, and the paper's
log-space power form (Table 5). Plain jnp at full precision (float64 inputs stay
float64), O(T^2), differentiable with plain autodiff; meant for tests and short inputs.

- `power_attention_reference`: y_i = sum_{j<=i} w_ij v_j / sum_{j<=i} w_ij with
  w_ij = (scale q_i . k_j)^p exp(G_i - G_j) (see `common`), optionally continuing
  from a state of earlier tokens.
- `power_attention_log_space`: the attention kernel's procedure (paper Appendix F.1,
  Table 5): S = scale Q K^T; S = p log(|S| + eps) (+ G_i - G_j); subtract the row max;
  exponentiate; normalize by the row sum. It differs from the definition only by
  eps (relative O(p eps / |s|)).
- `reference_state`: the state S_T, z_T after the sequence, from its definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from castle_jax.ops.numerics import math_dtype
from castle_jax.ops.power.common import (
  PowerState,
  attend,
  group_queries,
  normalize,
  validate_all,
)
from castle_jax.ops.power.expansion import expand

# The oracles must not lose digits to reduced-precision matmul passes on accelerators.
_PRECISION = jax.lax.Precision.HIGHEST


def _prepare(q, k, v, log_g):
  """Upcasts to the compute dtype; q grouped to [B, T, H_kv, group, d]; G = cumsum(log_g)."""
  dtype = math_dtype(q.dtype)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  cumulative = None if log_g is None else jnp.cumsum(log_g.astype(dtype), axis=1)
  return group_queries(q, k.shape[2]), k, v, cumulative


def power_attention_reference(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  scale: float | None = None,
  initial_state: PowerState | None = None,
  expansion: str = "spow",
  d_tile: int | None = None,
) -> jax.Array:
  """Causal power attention from its definition, O(T^2 d).

  y_i = [sum_{j<=i} w_ij v_j + e^{G_i} phi(scale q_i) S_0] / [sum_{j<=i} w_ij + e^{G_i} phi(scale q_i) . z_0],
  w_ij = (scale q_i . k_j)^p exp(G_i - G_j), G_i = sum_{l<=i} log_g_l. A query whose
  weights are all zero (q_i = 0) outputs 0 instead of 0/0. Each query's terms are divided
  by its largest one before they are summed (`common.attend`), which changes only the
  rounding and keeps gradients finite where the terms are tiny.

  Args:
    q: [batch, seq, heads, head_dim].
    k: [batch, seq, kv_heads, head_dim]; heads is a multiple of kv_heads.
    v: [batch, seq, kv_heads, value_dim].
    log_g: [batch, seq, kv_heads] log-gates (<= 0 for a discount), or None for no gating.
    p: even power >= 2.
    scale: score scale; None means 1/sqrt(head_dim).
    initial_state: the state of earlier tokens, or None (the sequence starts here).
    expansion, d_tile: the phi the initial state was built with (unused without one).

  Returns:
    [batch, seq, heads, value_dim] in q's dtype.
  """
  p, scale, d_tile = validate_all(q, k, v, log_g, p, scale, expansion, d_tile, initial_state)
  batch, seq, heads, _ = q.shape
  qg, k, v, cumulative = _prepare(q, k, v, log_g)
  state = None if initial_state is None else PowerState(*(x.astype(qg.dtype) for x in initial_state))
  out = attend(qg * scale, k, v, cumulative, p, state, expansion=expansion, d_tile=d_tile, precision=_PRECISION)
  return out.reshape(batch, seq, heads, v.shape[-1]).astype(q.dtype)


def power_attention_log_space(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  scale: float | None = None,
  eps: float = 1e-7,
) -> jax.Array:
  """The paper's attention-kernel procedure (Appendix F.1, Table 5), O(T^2 d).

  Per head: S = scale Q K^T; S = p log(|S| + eps) + (G_i - G_j) where j <= i, -inf
  elsewhere; P = exp(S - rowmax(S)); y = P V / rowsum(P). The power runs in log space,
  so scores of any magnitude stay finite; the row max cancels in the ratio (it is
  held constant under differentiation).

  Args:
    q, k, v, log_g, p, scale: as in `power_attention_reference`.
    eps: keeps log finite at a zero score (the authors use 1e-7).

  Returns:
    [batch, seq, heads, value_dim] in q's dtype.
  """
  p, scale, _ = validate_all(q, k, v, log_g, p, scale, "spow", None)
  if not eps >= 0:
    raise ValueError(f"eps must be >= 0, got {eps!r}")
  batch, seq, heads, _ = q.shape
  qg, k, v, cumulative = _prepare(q, k, v, log_g)
  scores = jnp.einsum("bihgd,bjhd->bhgij", qg * scale, k, precision=_PRECISION)
  logits = p * jnp.log(jnp.abs(scores) + eps)
  if cumulative is not None:
    g = jnp.moveaxis(cumulative, 1, -1)[:, :, None, :]  # [B, H_kv, 1, T]
    logits = logits + (g[..., :, None] - g[..., None, :])
  causal = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
  logits = jnp.where(causal, logits, -jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  probs = jnp.exp(logits - row_max)
  numerator = jnp.einsum("bhgij,bjhe->bihge", probs, v, precision=_PRECISION)
  denominator = jnp.moveaxis(jnp.sum(probs, axis=-1), -1, 1)
  out = normalize(numerator, denominator)
  return out.reshape(batch, seq, heads, v.shape[-1]).astype(q.dtype)


def reference_state(
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None = None,
  *,
  p: int = 2,
  expansion: str = "spow",
  d_tile: int | None = None,
  initial_state: PowerState | None = None,
) -> PowerState:
  """The state after the whole sequence, from its definition (materializes phi(K)).

  S_T = e^{G_T} S_0 + sum_j e^{G_T - G_j} phi(k_j) v_j^T,  z_T = e^{G_T} z_0 + sum_j e^{G_T - G_j} phi(k_j).

  Args:
    k: [batch, seq, kv_heads, head_dim]; v: [batch, seq, kv_heads, value_dim];
    log_g: [batch, seq, kv_heads] or None; initial_state: PowerState or None.

  Returns:
    PowerState(state [batch, kv_heads, D, value_dim], normalizer [batch, kv_heads, D])
    in the compute dtype.
  """
  p, _, d_tile = validate_all(k, k, v, log_g, p, None, expansion, d_tile, initial_state)
  _, k, v, cumulative = _prepare(k, k, v, log_g)
  phi_k = expand(k, p, expansion, d_tile)  # [B, T, H_kv, D]
  if cumulative is None:
    decay = jnp.ones(k.shape[:3], k.dtype)
    total = jnp.zeros((k.shape[0], k.shape[2]), k.dtype)
  else:
    total = cumulative[:, -1]
    decay = jnp.exp(total[:, None] - cumulative)
  state = jnp.einsum("bthD,bth,bthe->bhDe", phi_k, decay, v, precision=_PRECISION)
  normalizer = jnp.einsum("bthD,bth->bhD", phi_k, decay, precision=_PRECISION)
  if initial_state is not None:
    state += jnp.exp(total)[..., None, None] * initial_state.state.astype(state.dtype)
    normalizer += jnp.exp(total)[..., None] * initial_state.normalizer.astype(state.dtype)
  return PowerState(state, normalizer)
