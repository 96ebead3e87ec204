"""Power attention: the one public entry point.

`implementation`:
  - "reference": the attention form from the definition (O(T^2), plain jnp, full
    precision); a test oracle and fine for short sequences.
  - "xla": the chunked form (O(T c d + T D d_v), memory O(T d + (T / c) D d_v) per head).
  - "pallas": fused Pallas GPU kernels (pallas_kernels/power), p = 2, power-of-two head
    dims >= 16, chunk_size a multiple of the kernels' largest block (64 by default); runs
    in interpret mode on CPU (slow: for tests). States cross the boundary in `expansion`'s
    layout (the kernels use tspow with 16-feature tiles inside).
  - None: "pallas" on a GPU when the kernels support the inputs (p = 2, power-of-two
    dims, chunk_size a multiple of 64), else "xla"; the choice is logged at debug level.
"""

from __future__ import annotations

import logging

import jax

from castle_jax.ops.power.chunked import power_attention_chunked
from castle_jax.ops.power.common import PowerState, validate_all, validate_chunk_size
from castle_jax.ops.power.expansion import convert_expanded
from castle_jax.ops.power.reference import power_attention_reference, reference_state
from castle_jax.sharding import KV_SEQUENCE_HEADS_AXES, SEQUENCE_HEADS_AXES, map_over_shards
from pallas_kernels.power import power_attention_pallas
from pallas_kernels.power.ops import EXPANSION, unsupported_reason

IMPLEMENTATIONS = ("reference", "xla", "pallas")
PALLAS_DEFAULT_CHUNK_SIZE = 1024

_logger = logging.getLogger(__name__)


def power_attention(
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
    initial_state: PowerState | None = None,
    return_final_state: bool = False,
    implementation: str | None = None,
) -> jax.Array | tuple[jax.Array, PowerState]:
  """Causal power attention with optional per-head gating (paper Sec. 4).

  Per head, query i weighs key j <= i by w_ij = (scale q_i . k_j)^p exp(sum_{l=j+1..i} log_g_l)
  and returns sum_j w_ij v_j / sum_j w_ij. Equivalently: gated linear attention with the
  state expansion phi = `expansion` of dimension D (spow: C(d + p - 1, p)).

  Args:
    q: [batch, seq, heads, head_dim].
    k: [batch, seq, kv_heads, head_dim]; heads must be a multiple of kv_heads (GQA).
    v: [batch, seq, kv_heads, value_dim].
    log_g: [batch, seq, kv_heads] log-gates (e.g. log_sigmoid of a projection), or None.
    p: even power >= 2 (2 and 4 are the paper's).
    scale: score scale; None means 1/sqrt(head_dim), as in the authors' code.
    chunk_size: tokens per chunk (static); seq need not be a multiple. None: 128 for "xla",
      1024 for "pallas" (the kernels' measured sweet spot; clipped to the sequence).
    expansion: "spow", "tpow" or "tspow": the phi of the chunked form and of the state.
    d_tile: tile size of "tspow" (default 8 for p = 2, else 4).
    initial_state: PowerState from earlier tokens (e.g. a prompt), or None.
    return_final_state: also return the PowerState after the last token.
    implementation: one of IMPLEMENTATIONS or None (see module docstring).

  Returns:
    outputs [batch, seq, heads, value_dim] in q's dtype (bf16 inputs are computed in
    float32), and with return_final_state the PowerState (state [batch, kv_heads, D,
    value_dim], normalizer [batch, kv_heads, D], float32).

  Raises:
    ValueError: bad shapes/dtypes (naming the argument), odd or small p, bad scale,
      chunk_size, expansion or d_tile, unknown implementation.
  """
  p, scale, d_tile = validate_all(q, k, v, log_g, p, scale, expansion, d_tile, initial_state)
  requested_chunk = chunk_size
  chunk_size = validate_chunk_size(chunk_size)
  if implementation is None:
    implementation, why = _default_implementation(p, q, v, chunk_size)
    _logger.debug("power_attention: implementation=None -> %r (%s)", implementation, why)
  elif implementation not in IMPLEMENTATIONS:
    raise ValueError(f"Unknown power-attention implementation {implementation!r}; "
                     f"choose one of {IMPLEMENTATIONS} or None")
  if implementation == "pallas":
    if requested_chunk is None:
      chunk_size = PALLAS_DEFAULT_CHUNK_SIZE
    return _pallas(q, k, v, log_g, p=p, scale=scale, chunk_size=chunk_size, expansion=expansion, d_tile=d_tile,
                   initial_state=initial_state, return_final_state=return_final_state)
  options = dict(p=p, scale=scale, expansion=expansion, d_tile=d_tile, initial_state=initial_state)
  if implementation == "reference":
    out = power_attention_reference(q, k, v, log_g, **options)
    if not return_final_state:
      return out
    return out, reference_state(k, v, log_g, p=p, expansion=expansion, d_tile=d_tile, initial_state=initial_state)
  out, final_state = power_attention_chunked(q, k, v, log_g, chunk_size=chunk_size, **options)
  return (out, final_state) if return_final_state else out


def _default_implementation(p, q, v, chunk_size) -> tuple[str, str]:
  if jax.default_backend() != "gpu":
    return "xla", f"the Pallas kernels are GPU kernels; backend is {jax.default_backend()!r}"
  reason = unsupported_reason(p, q.shape[-1], v.shape[-1], q.dtype, chunk_size)
  return ("xla", reason) if reason else ("pallas", "GPU and supported inputs")


def _pallas(q, k, v, log_g, *, p, scale, chunk_size, expansion, d_tile, initial_state, return_final_state):
  reason = unsupported_reason(p, q.shape[-1], v.shape[-1], q.dtype, chunk_size)  # the kernels take no p
  if reason:
    raise ValueError(reason)
  head_dim = q.shape[-1]
  layout = (expansion, d_tile)

  def convert(state: PowerState, source, target) -> PowerState:
    return PowerState(convert_expanded(state.state, head_dim, p, source, target),
                      convert_expanded(state.normalizer[..., None], head_dim, p, source, target)[..., 0])

  if initial_state is not None:
    initial_state = convert(initial_state, layout, EXPANSION)
  def per_shard(q, k, v, log_g, initial_state):
    out, final = power_attention_pallas(q, k, v, log_g, scale=scale, chunk_size=chunk_size,
                                        initial_state=initial_state, return_final_state=return_final_state)
    return out, (None if final is None else PowerState(*final))

  state_axes = ("batch", "act_kv_heads")  # a prefix of PowerState's [batch, kv_heads, ...] leaves
  out, final_state = map_over_shards(
      per_shard, (q, k, v, log_g, initial_state),
      [SEQUENCE_HEADS_AXES, KV_SEQUENCE_HEADS_AXES, KV_SEQUENCE_HEADS_AXES, ("batch", None, "act_kv_heads"),
       state_axes],
      [SEQUENCE_HEADS_AXES, state_axes], what="power_attention")
  if not return_final_state:
    return out
  return out, convert(final_state, EXPANSION, layout)
