"""Power attention (p = 2) through the Pallas kernels, differentiable with a custom VJP.

`power_attention_triton` takes the [batch, seq, heads, dim] layout of the power-attention
entry point, folds heads into the batch, zero-pads the sequence to a multiple of the
chunk size (zero keys and zero log-gates change neither real outputs nor the final
state), and runs per chunk:

  1. `update_state` (Triton or Mosaic GPU): each chunk's own state dS_c = phi(K_c)^T diag(e^{G_c,last - G}) V_c
     and normalizer dz_c;
  2. `triton_discumsum.discumsum` (one launch walking the chunks): the state entering chunk c,
     S_c = e^{G_{c-1},last} S_{c-1} + dS_{c-1};
  3. `triton_kernels.query_state_attention`: outputs from S_c plus the intra-chunk attention,
     normalized.

States are kept float32 and use the tspow layout with 16-feature tiles
(`triton_kernels.expanded_dim`). They cross this module's boundary as plain (state,
normalizer) tuples, so the kernels depend on jax alone; the power-attention op
wraps them in its PowerState and converts between expansions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device_facts
from pallas_kernels.power import (
  mosaic_attention,
  mosaic_query_state,
  mosaic_state_gradient,
  mosaic_update_state,
  triton_discumsum,
  triton_kernels,
)
from pallas_kernels.power.config import (
  AUTO_MOSAIC_DTYPE,
  AUTO_MOSAIC_HEAD_DIMS,
  FEATURE_TILE,
  PowerTritonConfig,
  default_triton_config,
)
from pallas_kernels.residuals import keep_for_backward

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
EXPANSION = ("tspow", FEATURE_TILE)


def unsupported_reason(
  p: int, head_dim: int, value_dim: int, dtype, chunk_size: int, config: PowerTritonConfig | None = None
) -> str | None:
  """Why the kernels cannot run these inputs (a message naming the argument and the fix), or None.

  Takes sizes, not arrays, so that a FLOP count can ask the same question from a
  model config before any array exists.
  """
  config = config or default_triton_config()
  if p != 2:
    return f"implementation='triton' supports p=2 only, got p={p}; use implementation='xla'"
  for name, size in (("head_dim", head_dim), ("value_dim", value_dim)):
    if size < FEATURE_TILE or size & (size - 1):
      return (
        f"implementation='triton' needs a power-of-two {name} >= {FEATURE_TILE}, got {size}; use implementation='xla'"
      )
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    return (
      f"implementation='triton' supports {[jnp.dtype(d).name for d in SUPPORTED_DTYPES]}, got "
      f"{jnp.dtype(dtype).name}; use implementation='xla'"
    )
  multiple = config.chunk_multiple
  if chunk_size % multiple:
    return (
      f"chunk_size ({chunk_size}) must be a multiple of {multiple} (the kernels' largest block) for "
      f"implementation='triton'; try {max(multiple, chunk_size // multiple * multiple)}"
    )
  return None


def kernel_chunk_size(chunk_size: int, seq: int, config: PowerTritonConfig) -> int:
  """The chunk the kernels use: `chunk_size` (a multiple of config.chunk_multiple), or
  the sequence rounded up to that multiple when it is shorter (one chunk: the attention form)."""
  multiple = config.chunk_multiple
  return min(chunk_size, -(-seq // multiple) * multiple)


def _fold(x: jax.Array, length: int) -> jax.Array:
  """[B, T, H, ...] -> [B * H, length, ...], zero-padded along T."""
  batch, seq, heads = x.shape[:3]
  x = jnp.pad(x, [(0, 0), (0, length - seq)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x, 2, 1).reshape(batch * heads, length, *x.shape[3:])


def _unfold(x: jax.Array, batch: int, heads: int, seq: int) -> jax.Array:
  """[B * H, length, ...] -> [B, seq, H, ...]: the inverse of `_fold`."""
  return jnp.moveaxis(x.reshape(batch, heads, x.shape[1], *x.shape[2:]), 1, 2)[:, :seq]


def _fold_inputs(q, k, v, scale: float, length: int):
  """q (times scale, in q's dtype), k and v folded to [B * H, length, ...]."""
  return _fold((q.astype(jnp.float32) * scale).astype(q.dtype), length), _fold(k, length), _fold(v, length)


def _chunk_gates(log_g: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
  """Cumulative log-gates within each chunk [BH, T] and each chunk's total [BH, n]."""
  bh, length = log_g.shape
  cumulative = jnp.cumsum(log_g.astype(jnp.float32).reshape(bh, length // chunk, chunk), axis=-1)
  return cumulative.reshape(bh, length), cumulative[..., -1]


def _weighted(rows: jax.Array, weights: jax.Array, dtype) -> jax.Array:
  """rows [BH, T, d] times weights [BH, T], rounded once to the kernels' product dtype."""
  return (rows.astype(jnp.float32) * weights[..., None]).astype(dtype)


def _key_decay(g: jax.Array, totals: jax.Array, chunk: int) -> jax.Array:
  """r_j = e^{total - G_j} [BH, T]: how much key j is discounted by the end of its chunk."""
  return jnp.exp(jnp.repeat(totals, chunk, axis=1) - g)


def _as_rows(normalizers: jax.Array) -> jax.Array:
  """[..., D] -> [..., D / 16, 16]: normalizers in the [rows, cols] form the discumsum kernels take."""
  return normalizers.reshape(*normalizers.shape[:-1], -1, FEATURE_TILE)


def _states_entering_chunks(chunk_states, chunk_normalizers, totals, state, normalizer, *, state_dtype, interpret):
  """States entering each chunk [BH, n, D, d_v] (in `state_dtype`), normalizers [BH, n, D]
  (float32), and the final state and normalizer: S_0 = the initial state,
  S_{c+1} = e^{total_c} S_c + dS_c, carried in float32."""
  entering, final_state = triton_discumsum.discumsum(
    chunk_states, totals, state, entering_dtype=state_dtype, interpret=interpret
  )
  entering_normalizers, final_normalizer = triton_discumsum.discumsum(
    _as_rows(chunk_normalizers), totals, _as_rows(normalizer), interpret=interpret
  )
  return (
    entering,
    entering_normalizers.reshape(chunk_normalizers.shape),
    final_state,
    final_normalizer.reshape(normalizer.shape),
  )


def _expand_to_q_heads(x: jax.Array, group: int) -> jax.Array:
  """[B * kv_heads, ...] -> [B * heads, ...]: each kv head's row repeated for its query heads."""
  return jnp.repeat(x, group, axis=0) if group > 1 else x


def _sum_over_group(x: jax.Array, group: int) -> jax.Array:
  """[B * heads, ...] -> [B * kv_heads, ...]: sums a kv head's query heads."""
  return x.reshape(x.shape[0] // group, group, *x.shape[1:]).sum(axis=1) if group > 1 else x


def _forward(q, k, v, log_g, state, normalizer, *, scale, chunk, config, interpret):
  """Outputs [B, T, H, d_v], the final state and normalizer, and the residuals of the backward."""
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  length = -(-seq // chunk) * chunk
  q_folded, k_folded, v_folded = _fold_inputs(q, k, v, scale, length)
  g, totals = _chunk_gates(_fold(log_g, length), chunk)
  decay = _key_decay(g, totals, chunk)
  chunk_states, chunk_normalizers = update_state(
    k_folded, _weighted(v_folded, decay, q.dtype), decay, chunk=chunk, config=config, interpret=interpret
  )
  dim = chunk_states.shape[2]
  entering, entering_normalizers, final_state, final_normalizer = _states_entering_chunks(
    chunk_states,
    chunk_normalizers,
    totals,
    state.reshape(batch * kv_heads, dim, -1),
    normalizer.reshape(batch * kv_heads, dim),
    state_dtype=q.dtype,
    interpret=interpret,
  )
  out_folded, denominator = in_chunk_attention_forward(
    q_folded,
    k_folded,
    v_folded,
    g,
    entering,
    entering_normalizers,
    heads=heads,
    kv_heads=kv_heads,
    chunk=chunk,
    config=config,
    interpret=interpret,
  )
  out = _unfold(out_folded, batch, heads, seq)
  residuals = (out_folded, denominator, entering, entering_normalizers, g, totals)
  return (out, final_state.reshape(state.shape), final_normalizer.reshape(normalizer.shape)), residuals


def _reverse_states_entering_chunks(
  query_states, query_normalizers, totals, entering, entering_normalizers, d_final, d_final_normalizer, *, interpret
):
  """Backward of `_states_entering_chunks`: the gradients of each chunk's own state
  [BH, n, D, d_v] and normalizer [BH, n, D], of the totals [BH, n], and of the initial
  state and normalizer, from the direct gradients of the entering states (the query side's)."""
  d_own, d_totals, d_initial = triton_discumsum.reverse_discumsum(
    query_states, totals, entering, d_final, interpret=interpret
  )
  d_own_normalizer, d_totals_normalizer, d_initial_normalizer = triton_discumsum.reverse_discumsum(
    _as_rows(query_normalizers),
    totals,
    _as_rows(entering_normalizers),
    _as_rows(d_final_normalizer),
    interpret=interpret,
  )
  return (
    d_own,
    d_own_normalizer.reshape(query_normalizers.shape),
    d_totals + d_totals_normalizer,
    d_initial,
    d_initial_normalizer.reshape(d_final_normalizer.shape),
  )


def _output_cotangents(d_out, out_folded, denominator, length):
  """y = N / den: dN = dy / den and dden = -(dy . y) / den, [B * H, length, d_v] and [B * H, length]."""
  d_y = _fold(d_out.astype(jnp.float32), length)
  zero = denominator == 0.0
  safe = jnp.where(zero, 1.0, denominator)
  d_num = jnp.where(zero[..., None], 0.0, d_y / safe[..., None])
  d_den = jnp.where(zero, 0.0, -jnp.sum(d_y * out_folded.astype(jnp.float32), axis=-1) / safe)
  return d_num, d_den


def _runs_on_mosaic(choice: str, module, *, head_dim, value_dim, dtype, chunk, interpret, part: str) -> bool:
  """Whether a config's kernel `choice` ("auto", "triton" or "mosaic", `PowerTritonConfig`) runs
  `module`'s Mosaic GPU kernels; "auto" by `part`'s measured dims."""
  if choice == "triton":
    return False
  if module.unsupported_reason(head_dim=head_dim, value_dim=value_dim, dtype=dtype, chunk=chunk):
    return False
  on_hopper = device_facts.is_hopper(device_facts.compute_capability())
  if choice == "mosaic":
    return interpret or on_hopper
  faster = AUTO_MOSAIC_HEAD_DIMS[part]
  measured = jnp.dtype(dtype) == jnp.dtype(AUTO_MOSAIC_DTYPE) and head_dim in faster and value_dim in faster
  return not interpret and on_hopper and measured


def parts_on_mosaic(
  config: PowerTritonConfig, *, head_dim: int, value_dim: int, dtype, chunk: int, interpret: bool | None = None
) -> tuple[str, ...]:
  """The parts of the op (`AUTO_MOSAIC_HEAD_DIMS`' names) that run Mosaic GPU kernels under `config`
  on this device, for heads of `head_dim` / `value_dim` in `dtype` and chunks of `chunk`
  (`interpret` as for `power_attention_triton`: None means on CPU). The kernels' dispatch asks it."""
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  mosaic = functools.partial(
    _runs_on_mosaic, head_dim=head_dim, value_dim=value_dim, dtype=dtype, chunk=chunk, interpret=interpret
  )
  attention = mosaic(config.in_chunk_attention, mosaic_attention, part="in_chunk_attention")
  runs = {
    "in_chunk_attention": attention,
    "update_state": mosaic(config.update_state, mosaic_update_state, part="update_state"),
    # The Triton query kernel computes the states' part and the attention together.
    "query_state": attention and mosaic(config.query_state, mosaic_query_state, part="query_state"),
    "state_gradient_queries": mosaic(config.state_gradient, mosaic_state_gradient, part="state_gradient_queries"),
    "state_gradient_keys": mosaic(config.state_gradient, mosaic_state_gradient, part="state_gradient_keys"),
  }
  return tuple(part for part, on_mosaic in runs.items() if on_mosaic)


def _on_mosaic(part: str, x, w, *, chunk, config, interpret) -> bool:
  """Whether `part` runs on Mosaic GPU for rows x [.., d] and w [.., d_v] (`parts_on_mosaic`)."""
  dims = dict(head_dim=x.shape[-1], value_dim=w.shape[-1], dtype=x.dtype, chunk=chunk, interpret=interpret)
  return part in parts_on_mosaic(config, **dims)


def state_gradient(x, cotangent, cotangent_normalizer, state, normalizer, *, chunk, config, interpret, **options):
  """Gradients through a state product (`triton_kernels.state_gradient`'s contract) through the
  kernel `config.state_gradient` names, where it applies; `options`: heads, kv_heads, with_product."""
  inputs = (x, cotangent, cotangent_normalizer, state, normalizer)
  part = "state_gradient_keys" if options.get("with_product") else "state_gradient_queries"
  if _on_mosaic(part, x, cotangent, chunk=chunk, config=config, interpret=interpret):
    return mosaic_state_gradient.state_gradient(
      *inputs, chunk=chunk, stages=config.mosaic_stages, interpret=interpret, **options
    )
  return triton_kernels.state_gradient(*inputs, chunk=chunk, config=config, interpret=interpret, **options)


def update_state(x, w, u, *, chunk, config, interpret):
  """Each chunk's state and normalizer (`triton_kernels.update_state`'s contract) through the kernel
  `config.update_state` names, where it applies."""
  if _on_mosaic("update_state", x, w, chunk=chunk, config=config, interpret=interpret):
    return mosaic_update_state.update_state(x, w, u, chunk=chunk, stages=config.mosaic_stages, interpret=interpret)
  return triton_kernels.update_state(x, w, u, chunk=chunk, config=config, interpret=interpret)


def in_chunk_attention_forward(q, k, v, g, state, normalizer, *, heads, kv_heads, chunk, config, interpret):
  """Normalized outputs and denominators (`triton_kernels.query_state_attention`'s contract), the
  attention within chunks through the kernels `config.in_chunk_attention` names, where they apply."""
  options = dict(heads=heads, kv_heads=kv_heads, chunk=chunk)
  choice = dict(chunk=chunk, config=config, interpret=interpret)
  if not _on_mosaic("in_chunk_attention", q, v, **choice):
    return triton_kernels.query_state_attention(
      q, k, v, g, state, normalizer, config=config, interpret=interpret, **options
    )
  states = ()
  if state is not None and _on_mosaic("query_state", q, v, **choice):
    states = mosaic_query_state.query_state(
      q, g, state, normalizer, stages=config.mosaic_stages, interpret=interpret, **options
    )
  elif state is not None:
    states = triton_kernels.query_state_attention(
      q, k, v, g, state, normalizer, config=config, interpret=interpret, with_attention=False, **options
    )
  return mosaic_attention.attention_forward(
    q, k, v, g, *states, stages=config.mosaic_stages, interpret=interpret, **options
  )


def in_chunk_attention_backward(q, k, v, g, d_num, d_den, *, heads, kv_heads, chunk, config, interpret):
  """The in-chunk attention's gradients (`triton_kernels.attention_backward`'s contract) through the
  kernels `config.in_chunk_attention` names, where they apply."""
  if _on_mosaic("in_chunk_attention", q, v, chunk=chunk, config=config, interpret=interpret):
    return mosaic_attention.attention_backward(
      q,
      k,
      v,
      g,
      d_num,
      d_den,
      heads=heads,
      kv_heads=kv_heads,
      chunk=chunk,
      stages=config.mosaic_stages,
      interpret=interpret,
    )
  return triton_kernels.attention_backward(
    q, k, v, g, d_num, d_den, heads=heads, kv_heads=kv_heads, chunk=chunk, config=config, interpret=interpret
  )


def _log_gate_gradient(d_g, d_totals, chunk):
  """Gradient of the log-gates [BH, T] from those of G [BH, T] (the cumulative sum within each
  chunk) and of each chunk's total [BH, n] (G's last entry)."""
  bh, length = d_g.shape
  d_g = d_g.reshape(bh, -1, chunk).at[..., -1].add(d_totals)
  return jnp.flip(jnp.cumsum(jnp.flip(d_g, axis=-1), axis=-1), axis=-1).reshape(bh, length)


def _backward(q, k, v, log_g, state, normalizer, residuals, cotangents, *, scale, chunk, config, interpret):
  out_folded, denominator, entering, entering_normalizers, g, totals = residuals
  d_out, d_final, d_final_normalizer = cotangents
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  group = heads // kv_heads
  length = out_folded.shape[1]
  dtype = q.dtype
  options = dict(chunk=chunk, config=config, interpret=interpret)
  q_folded, k_folded, v_folded = _fold_inputs(q, k, v, scale, length)

  d_num, d_den = _output_cotangents(d_out, out_folded, denominator, length)

  # Query state e^{G_i} phi(q_i) [S, z]: gradients of q, of G and of the entering states.
  discount = jnp.exp(_expand_to_q_heads(g, group))
  weighted_d_num = _weighted(d_num, discount, dtype)
  d_den_discounted = d_den * discount
  dq, dg_q = state_gradient(
    q_folded,
    weighted_d_num,
    d_den_discounted,
    entering,
    entering_normalizers,
    heads=heads,
    kv_heads=kv_heads,
    **options,
  )
  query_states, query_normalizers = update_state(q_folded, weighted_d_num, d_den_discounted, **options)
  d_own, d_own_normalizer, d_totals, d_initial, d_initial_normalizer = _reverse_states_entering_chunks(
    _sum_over_group(query_states, group),
    _sum_over_group(query_normalizers, group),
    totals,
    entering,
    entering_normalizers,
    d_final.reshape(batch * kv_heads, *d_final.shape[2:]).astype(jnp.float32),
    d_final_normalizer.reshape(batch * kv_heads, -1).astype(jnp.float32),
    interpret=interpret,
  )

  # Each chunk's own state sum_j r_j phi(k_j) [v_j, 1], r_j = e^{total - G_j}.
  decay = _key_decay(g, totals, chunk)
  dk, d_log_decay, dv_product = state_gradient(
    k_folded,
    _weighted(v_folded, decay, dtype),
    decay,
    d_own.astype(dtype),
    d_own_normalizer,
    heads=kv_heads,
    kv_heads=kv_heads,
    with_product=True,
    **options,
  )
  dv = dv_product * decay[..., None]

  # Intra-chunk attention.
  dq_att, dg_q_att, dk_att, dv_att, dg_k_att = in_chunk_attention_backward(
    q_folded, k_folded, v_folded, g, d_num.astype(dtype), d_den, heads=heads, kv_heads=kv_heads, **options
  )
  dq = (dq + dq_att) * scale
  dk = dk + dk_att
  dv = dv + dv_att

  # Log-gates: G_i is the cumulative sum within the chunk, total_c its last entry.
  bh = batch * kv_heads
  d_g = _sum_over_group(dg_q + dg_q_att, group) + dg_k_att - d_log_decay
  d_log_g = _log_gate_gradient(d_g, d_totals + d_log_decay.reshape(bh, -1, chunk).sum(axis=-1), chunk)

  return (
    _unfold(dq, batch, heads, seq).astype(q.dtype),
    _unfold(dk, batch, kv_heads, seq).astype(k.dtype),
    _unfold(dv, batch, kv_heads, seq).astype(v.dtype),
    _unfold(d_log_g, batch, kv_heads, seq).astype(log_g.dtype),
    d_initial.reshape(state.shape),
    d_initial_normalizer.reshape(normalizer.shape),
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _power_attention(q, k, v, log_g, state, normalizer, scale, chunk, config, interpret):
  outputs, _ = _forward(q, k, v, log_g, state, normalizer, scale=scale, chunk=chunk, config=config, interpret=interpret)
  return outputs


def _power_attention_fwd(q, k, v, log_g, state, normalizer, scale, chunk, config, interpret):
  outputs, residuals = keep_for_backward(
    _forward(q, k, v, log_g, state, normalizer, scale=scale, chunk=chunk, config=config, interpret=interpret)
  )
  return outputs, (q, k, v, log_g, state, normalizer, residuals)


def _power_attention_bwd(scale, chunk, config, interpret, saved, cotangents):
  *inputs, residuals = saved
  return _backward(*inputs, residuals, cotangents, scale=scale, chunk=chunk, config=config, interpret=interpret)


_power_attention.defvjp(_power_attention_fwd, _power_attention_bwd)


def _attention_form_forward(q, k, v, log_g, *, scale, chunk, config, interpret):
  """One chunk and no state: outputs [B, T, H, d_v] and the residuals of the backward."""
  batch, seq, heads, _ = q.shape
  q_folded, k_folded, v_folded = _fold_inputs(q, k, v, scale, chunk)
  g, _ = _chunk_gates(_fold(log_g, chunk), chunk)
  out_folded, denominator = in_chunk_attention_forward(
    q_folded,
    k_folded,
    v_folded,
    g,
    None,
    None,
    heads=heads,
    kv_heads=k.shape[2],
    chunk=chunk,
    config=config,
    interpret=interpret,
  )
  return _unfold(out_folded, batch, heads, seq), (out_folded, denominator, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _power_attention_form(q, k, v, log_g, scale, chunk, config, interpret):
  return _attention_form_forward(q, k, v, log_g, scale=scale, chunk=chunk, config=config, interpret=interpret)[0]


def _power_attention_form_fwd(q, k, v, log_g, scale, chunk, config, interpret):
  out, residuals = keep_for_backward(
    _attention_form_forward(q, k, v, log_g, scale=scale, chunk=chunk, config=config, interpret=interpret)
  )
  return out, (q, k, v, log_g, residuals)


def _power_attention_form_bwd(scale, chunk, config, interpret, saved, d_out):
  q, k, v, log_g, (out_folded, denominator, g) = saved
  batch, seq, heads, _ = q.shape
  kv_heads = k.shape[2]
  q_folded, k_folded, v_folded = _fold_inputs(q, k, v, scale, chunk)
  d_num, d_den = _output_cotangents(d_out, out_folded, denominator, chunk)
  dq, dg_q, dk, dv, dg_k = in_chunk_attention_backward(
    q_folded,
    k_folded,
    v_folded,
    g,
    d_num.astype(q.dtype),
    d_den,
    heads=heads,
    kv_heads=kv_heads,
    chunk=chunk,
    config=config,
    interpret=interpret,
  )
  d_g = _sum_over_group(dg_q, heads // kv_heads) + dg_k
  d_log_g = _log_gate_gradient(d_g, jnp.zeros((d_g.shape[0], 1), jnp.float32), chunk)
  return (
    _unfold(dq * scale, batch, heads, seq).astype(q.dtype),
    _unfold(dk, batch, kv_heads, seq).astype(k.dtype),
    _unfold(dv, batch, kv_heads, seq).astype(v.dtype),
    _unfold(d_log_g, batch, kv_heads, seq).astype(log_g.dtype),
  )


_power_attention_form.defvjp(_power_attention_form_fwd, _power_attention_form_bwd)


def power_attention_triton(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  log_g: jax.Array | None,
  *,
  scale: float,
  chunk_size: int,
  initial_state: tuple[jax.Array, jax.Array] | None = None,
  return_final_state: bool = True,
  config: PowerTritonConfig | None = None,
  interpret: bool | None = None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
  """Causal power attention, p = 2, through the Pallas kernels (inputs already validated).

  Args:
    q: [batch, seq, heads, head_dim]; head_dim a power of two >= 16.
    k: [batch, seq, kv_heads, head_dim]; v: [batch, seq, kv_heads, value_dim], value_dim a
      power of two >= 16.
    log_g: [batch, seq, kv_heads] or None.
    scale: the score scale.
    chunk_size: a multiple of `config.chunk_multiple` (a longer one than seq is clipped).
    initial_state: (state [batch, kv_heads, D, value_dim], normalizer [batch, kv_heads, D]) in
      the kernels' layout (tspow, d_tile 16; D = `triton_kernels.expanded_dim(head_dim)`), or None.
    return_final_state: False skips what only the final state needs; with no initial state
      and seq within one chunk that is every state kernel (the attention form alone).
    config: kernel tiles; None means `default_triton_config()`.
    interpret: run the kernels in Pallas interpret mode; None means on CPU.

  Returns:
    outputs [batch, seq, heads, value_dim] in q's dtype and the final (state, normalizer)
    (float32, tspow layout with d_tile 16), None when not return_final_state.
  """
  config = config or default_triton_config()
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  batch, seq, _, head_dim = q.shape
  kv_heads, value_dim = k.shape[2], v.shape[3]
  reason = unsupported_reason(2, head_dim, value_dim, q.dtype, chunk_size, config)
  if reason:
    raise ValueError(reason)
  chunk = kernel_chunk_size(chunk_size, seq, config)
  if log_g is None:
    log_g = jnp.zeros((batch, seq, kv_heads), jnp.float32)
  if not return_final_state and initial_state is None and seq <= chunk:
    return _power_attention_form(q, k, v, log_g, scale, chunk, config, interpret), None
  dim = triton_kernels.expanded_dim(head_dim)
  if initial_state is None:
    initial_state = (
      jnp.zeros((batch, kv_heads, dim, value_dim), jnp.float32),
      jnp.zeros((batch, kv_heads, dim), jnp.float32),
    )
  initial, initial_normalizer = initial_state
  out, state, normalizer = _power_attention(
    q, k, v, log_g, initial.astype(jnp.float32), initial_normalizer.astype(jnp.float32), scale, chunk, config, interpret
  )
  return out, ((state, normalizer) if return_final_state else None)
