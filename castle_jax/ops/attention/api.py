"""Standard causal multi-head attention: the one entry point.

`implementation`:
  - "reference": plain jnp with an explicit mask (any backend, float32 math).
  - "xla": `jax.nn.dot_product_attention(implementation="xla")`.
  - "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")`, cuDNN flash
    attention; needs a CUDA GPU, bf16/fp16 inputs and a head dim that is a multiple
    of 8 and at most 256.
  - None: "cudnn" where it can run, else "xla" (`castle_jax.ops.backend.choose`: logged
    at debug level; an explicit "cudnn" that cannot run raises).

With `alibi=True` (and a window) the scores get ALiBi biases (`alibi.py`): "reference"
is the full-mask definition, "xla" and "cudnn" the blockwise layout (W queries against
2W keys, one [heads, W, 2W] bias table).

Signatures of what comes next (not implemented yet):
  - explicit positions: `causal_attention(..., q_positions=None, k_positions=None)`,
    int [batch, seq], for biases over non-consecutive positions; `masked_attention`
    already takes a mask and a bias built from positions (`causal_mask`, `alibi_bias`).

Cross-attention over another model's cache (LongSpec's draft) and tree verification
(drafted nodes over a cache and, masked, over each other) are `castle_jax.ops.tree_attention`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from castle_jax.ops.attention.alibi import alibi_window_attention, alibi_window_reference
from castle_jax.ops.attention.reference import causal_mask, masked_attention
from castle_jax.ops.backend import Implementation, choose

IMPLEMENTATIONS = ("reference", "xla", "cudnn")
_DEFAULT_ORDER = ("cudnn", "xla")


def cudnn_unsupported_reason(q: jax.Array) -> str | None:
  """Why cuDNN flash attention cannot run q (None: it can)."""
  if jax.default_backend() != "gpu":
    return f"cuDNN attention needs a CUDA GPU; the default backend is {jax.default_backend()!r}"
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    return f"cuDNN attention needs bfloat16 or float16 inputs, got {q.dtype}"
  head_dim = q.shape[-1]
  if head_dim % 8 or head_dim > 256:
    return f"cuDNN attention needs head_dim a multiple of 8 and <= 256, got {head_dim}"
  return None


def _cudnn_alibi_unsupported_reason(alibi: bool, window: int | None) -> str | None:
  # ALiBi runs as blocks of `window` queries over 2 * window keys with a bias, and cuDNN's
  # biased backward takes even lengths only.
  if alibi and window % 2:
    return f"cuDNN ALiBi attention needs an even window (cuDNN's biased backward takes even lengths), got {window}"
  return None


def _validate(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have shape [batch, seq, heads, head_dim]; got shape {x.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got k {k.shape} and v {v.shape}")
  if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q {q.shape} and k {k.shape} must agree in batch, seq and head_dim for causal self-attention")
  if q.shape[2] % k.shape[2]:
    raise ValueError(
      f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]}) for grouped-query attention"
    )
  if window is not None and window < 1:
    raise ValueError(f"window must be None or >= 1, got {window}")


def causal_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  window: int | None = None,
  alibi: bool = False,
  implementation: str | None = None,
) -> jax.Array:
  """Causal softmax attention, optionally grouped-query, sliding-window and ALiBi-biased.

  Args:
    q: [batch, seq, heads, head_dim].
    k, v: [batch, seq, kv_heads, head_dim]; heads % kv_heads == 0.
    window: None for full causal attention; W >= 1 lets each query see itself and
      the W-1 keys before it.
    alibi: add ALiBi biases -m_h (i - j) (positions 0..seq-1); needs a window.
    implementation: one of IMPLEMENTATIONS or None (see module docstring).

  Returns:
    [batch, seq, heads, head_dim] in q's dtype.
  """
  _validate(q, k, v, window)
  if alibi and window is None:
    raise ValueError(
      "causal_attention(alibi=True) needs a window: ALiBi runs as sliding-window attention here "
      "(set model.sliding_window)"
    )
  implementations = {
    "reference": Implementation(),
    "xla": Implementation(),
    "cudnn": Implementation(lambda: cudnn_unsupported_reason(q) or _cudnn_alibi_unsupported_reason(alibi, window)),
  }
  implementation = choose("causal_attention", implementation, implementations, _DEFAULT_ORDER)

  if alibi:
    if implementation == "reference":
      return alibi_window_reference(q, k, v, window=window)
    return alibi_window_attention(q, k, v, window=window, implementation=implementation)
  if implementation == "reference":
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    return masked_attention(q, k, v, causal_mask(positions, positions, window))
  local_window = None if window is None else (window - 1, 0)
  return jax.nn.dot_product_attention(
    q, k, v, is_causal=True, local_window_size=local_window, implementation=implementation
  )
