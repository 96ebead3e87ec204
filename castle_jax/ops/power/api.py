"""Power attention: the one public entry point.

`implementation`:
  - "reference": the attention form from the definition (O(T^2), plain jnp, full
    precision); a test oracle and fine for short sequences.
  - "xla": the chunked form (O(T c d + T D d_v), memory O(T d + (T / c) D d_v) per head).
  - "triton": fused Pallas Triton kernels (pallas_kernels/power), p = 2, power-of-two head
    dims >= 16, chunk_size a multiple of the kernels' largest block (64 by default); runs
    in interpret mode on CPU (slow: for tests). States cross the boundary in `expansion`'s
    layout (the kernels use tspow with 16-feature tiles inside). `kernel_config` a
    `PowerTritonConfig`.
  - None: "triton" on a GPU when the kernels support the inputs (p = 2, power-of-two
    dims, chunk_size a multiple of 64), else "xla" (`castle_jax.ops.backend.choose`:
    logged at debug level; an explicit choice that cannot run raises).

The implementation and the chunk size are decided together, once, by `resolve`: the op
calls it with the inputs' sizes, and a model's FLOP count calls it with the config's,
so the reported MFU counts the chunk that actually runs. Unless the caller fixes
chunk_size, the kernels run the cheaper of two forms by FLOPs (`triton_chunk_size`): the
whole sequence as one chunk (plain (q . k)^p attention, no state) or chunks of
TRITON_DEFAULT_CHUNK_SIZE.
"""

from __future__ import annotations

import math

import jax

from castle_jax.ops.backend import Implementation, choose, rejects_renamed_arguments
from castle_jax.ops.power.xla import power_attention_chunked
from castle_jax.ops.power.common import DEFAULT_CHUNK_SIZE, PowerState, validate_all, validate_chunk_size
from castle_jax.ops.power.expansion import convert_expanded
from castle_jax.ops.power.reference import power_attention_reference, reference_state
from castle_jax.sharding import KV_SEQUENCE_HEADS_AXES, SEQUENCE_HEADS_AXES, map_over_shards
from pallas_kernels.power import PowerTritonConfig, default_triton_config, power_attention_triton
from pallas_kernels.power.triton import EXPANSION, unsupported_reason

IMPLEMENTATIONS = ("reference", "xla", "triton")
DEFAULT_ORDER = ("triton", "xla")
# The kernel config type of each kernel implementation (`kernel_config=`).
KERNEL_CONFIGS = {"triton": PowerTritonConfig}
# The kernels' fastest chunk for sequences longer than the attention form pays for, in the
# chunk sweep of benchmarks/RESULTS.md; the XLA path's is DEFAULT_CHUNK_SIZE.
TRITON_DEFAULT_CHUNK_SIZE = 1024


def triton_chunk_size(seq_len: int, *, p: int, head_dim: int, value_dim: int, chunk_multiple: int) -> int:
  """The chunk the Triton kernels run for `seq_len` tokens when the caller fixes none.

  Per token and query head, the attention form (one chunk of the whole sequence, no
  state) costs 2 d (T + 1) FLOPs in its causal (q . k) and (w . v) products; the chunked
  form costs 4 D d_v for the state update and the query-state product (D = C(d + p - 1, p),
  the smallest exact expansion) plus 2 d (c + 1) inside its chunks of c tokens. The
  attention form is the cheaper while T <= 2 D d_v / d + c, so it runs up to there
  (the sequence rounded up to `chunk_multiple`, the kernels' largest block), and chunks
  of TRITON_DEFAULT_CHUNK_SIZE run beyond. On the H100 this rule picked the fastest
  measured form, or one within 3% of it, at every length and head dim of the sweep.
  """
  expanded = math.comb(head_dim + p - 1, p)
  chunk = TRITON_DEFAULT_CHUNK_SIZE
  if seq_len <= 2 * expanded * value_dim // head_dim + chunk:
    return max(chunk_multiple, -(-seq_len // chunk_multiple) * chunk_multiple)
  return chunk


def resolve(
  implementation: str | None,
  chunk_size: int | None,
  *,
  seq_len: int,
  p: int,
  head_dim: int,
  value_dim: int,
  dtype,
  kernel_config: PowerTritonConfig | None = None,
) -> tuple[str, int]:
  """(implementation, chunk size) that `power_attention` runs for inputs of these sizes.

  chunk_size None means the implementation's own: `triton_chunk_size` for "triton" (the
  cheaper of the attention form and chunks of TRITON_DEFAULT_CHUNK_SIZE for seq_len
  tokens), DEFAULT_CHUNK_SIZE for "xla" (whose attention form would hold T^2 scores per
  head; "reference" has no chunks). The default implementation is "triton" on a GPU
  where the kernels take p, the dims, the dtype and that chunk, else "xla".

  Raises:
    ValueError: a bad chunk_size, an unknown implementation, or an explicit one that
      cannot run (naming why and the alternatives).
  """
  if chunk_size is not None:
    chunk_size = validate_chunk_size(chunk_size)

  def chunk_for(name: str) -> int:
    if chunk_size is not None:
      return chunk_size
    if name != "triton":
      return DEFAULT_CHUNK_SIZE
    multiple = (kernel_config or default_triton_config()).chunk_multiple
    return triton_chunk_size(seq_len, p=p, head_dim=head_dim, value_dim=value_dim, chunk_multiple=multiple)

  implementations = {
    "reference": Implementation(),
    "xla": Implementation(),
    "triton": Implementation(
      lambda: unsupported_reason(p, head_dim, value_dim, dtype, chunk_for("triton"), kernel_config),
      default_backends=("gpu",),
      config_type=PowerTritonConfig,
    ),
  }
  chosen = choose("power_attention", implementation, implementations, DEFAULT_ORDER, kernel_config=kernel_config)
  return chosen, chunk_for(chosen)


@rejects_renamed_arguments
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
  kernel_config: PowerTritonConfig | None = None,
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
    chunk_size: tokens per chunk (static); seq need not be a multiple. None: 128 for "xla";
      for "triton" the whole sequence (the attention form) while that costs fewer FLOPs
      than chunks, else 1024 (`triton_chunk_size`).
    expansion: "spow", "tpow" or "tspow": the phi of the chunked form and of the state.
    d_tile: tile size of "tspow" (default 8 for p = 2, else 4).
    initial_state: PowerState from earlier tokens (e.g. a prompt), or None.
    return_final_state: also return the PowerState after the last token.
    implementation: one of IMPLEMENTATIONS or None (see module docstring).
    kernel_config: a `PowerTritonConfig` for "triton" (None: its default).

  Returns:
    outputs [batch, seq, heads, value_dim] in q's dtype (bf16 inputs are computed in
    float32), and with return_final_state the PowerState (state [batch, kv_heads, D,
    value_dim], normalizer [batch, kv_heads, D], float32).

  Raises:
    ValueError: bad shapes/dtypes (naming the argument), odd or small p, bad scale,
      chunk_size, expansion or d_tile, unknown implementation.
  """
  p, scale, d_tile = validate_all(q, k, v, log_g, p, scale, expansion, d_tile, initial_state)
  implementation, chunk_size = resolve(
    implementation,
    chunk_size,
    seq_len=q.shape[1],
    p=p,
    head_dim=q.shape[-1],
    value_dim=v.shape[-1],
    dtype=q.dtype,
    kernel_config=kernel_config,
  )
  if implementation == "triton":
    return _triton(
      q,
      k,
      v,
      log_g,
      p=p,
      scale=scale,
      chunk_size=chunk_size,
      expansion=expansion,
      d_tile=d_tile,
      initial_state=initial_state,
      return_final_state=return_final_state,
      config=kernel_config,
    )
  options = dict(p=p, scale=scale, expansion=expansion, d_tile=d_tile, initial_state=initial_state)
  if implementation == "reference":
    out = power_attention_reference(q, k, v, log_g, **options)
    if not return_final_state:
      return out
    return out, reference_state(k, v, log_g, p=p, expansion=expansion, d_tile=d_tile, initial_state=initial_state)
  out, final_state = power_attention_chunked(q, k, v, log_g, chunk_size=chunk_size, **options)
  return (out, final_state) if return_final_state else out


def _triton(q, k, v, log_g, *, p, scale, chunk_size, expansion, d_tile, initial_state, return_final_state, config):
  head_dim = q.shape[-1]
  layout = (expansion, d_tile)

  def convert(state: PowerState, source, target) -> PowerState:
    return PowerState(
      convert_expanded(state.state, head_dim, p, source, target),
      convert_expanded(state.normalizer[..., None], head_dim, p, source, target)[..., 0],
    )

  if initial_state is not None:
    initial_state = convert(initial_state, layout, EXPANSION)

  def per_shard(q, k, v, log_g, initial_state):
    out, final = power_attention_triton(
      q,
      k,
      v,
      log_g,
      scale=scale,
      chunk_size=chunk_size,
      initial_state=initial_state,
      return_final_state=return_final_state,
      config=config,
    )
    return out, (None if final is None else PowerState(*final))

  state_axes = ("batch", "act_kv_heads")  # a prefix of PowerState's [batch, kv_heads, ...] leaves
  out, final_state = map_over_shards(
    per_shard,
    (q, k, v, log_g, initial_state),
    [SEQUENCE_HEADS_AXES, KV_SEQUENCE_HEADS_AXES, KV_SEQUENCE_HEADS_AXES, ("batch", None, "act_kv_heads"), state_axes],
    [SEQUENCE_HEADS_AXES, state_axes],
    what="power_attention",
  )
  if not return_final_state:
    return out
  return out, convert(final_state, EXPANSION, layout)
