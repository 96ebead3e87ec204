"""Causal sliding-window attention with ALiBi position biases (the DRT decoder's self-attention).

Per head h with slope m_h = 2^(-8 (h + 1) / heads) (Press et al., 2022, as the GCA
paper's code writes it for any head count), query i sees key j iff
0 <= i - j < window, with score q_i . k_j * scale - m_h (i - j).

Training runs blockwise: the sequence is cut into blocks of `window` queries, and each
block attends to the keys of its own block and of the block before (2 * window keys),
the visibility and the ALiBi bias being the same [heads, window, 2 * window] table for
every block. So the bias never grows with the sequence (a [heads, T, T] bias at T = 16K
would be 6 GB), and the same layout runs on cuDNN (blocks folded into the batch, the
first block's missing predecessor cut off with key_value_seq_lengths) and in XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.ops.attention.reference import causal_mask


def alibi_slopes(heads: int) -> np.ndarray:
  """float32 [heads]: m_h = 2^(-8 (h + 1) / heads)."""
  return np.exp2(-8.0 * np.arange(1, heads + 1) / heads).astype(np.float32)


def alibi_bias(q_positions: jax.Array, k_positions: jax.Array, heads: int) -> jax.Array:
  """float32 [batch, heads, q_len, k_len]: -m_h * (query position - key position).

  Args:
    q_positions: int [batch, q_len]; k_positions: int [batch, k_len].
  """
  distance = (q_positions[:, :, None] - k_positions[:, None, :]).astype(jnp.float32)
  return -jnp.asarray(alibi_slopes(heads))[None, :, None, None] * distance[:, None]


def alibi_window_reference(
  q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, scale: float | None = None
) -> jax.Array:
  """The definition with a full [T, T] mask and bias, in float32 (a test oracle).

  Args:
    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim].
    window: each query sees itself and the window - 1 keys before it.

  Returns:
    [batch, seq, heads, head_dim] in q's dtype.
  """
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  scale = head_dim**-0.5 if scale is None else scale
  positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
  qg = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim).astype(jnp.float32)
  scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision="highest") * scale
  scores += alibi_bias(positions, positions, heads).reshape(batch, kv_heads, heads // kv_heads, seq, seq)
  visible = causal_mask(positions, positions, window)[:, None, None]
  weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v.astype(jnp.float32), precision="highest")
  return out.reshape(q.shape).astype(q.dtype)


def _block_bias(window: int, heads: int) -> np.ndarray:
  """float32 [heads, window, 2 window]: ALiBi bias of a query block against [its own block;
  the block before], -inf where not visible. Query i sits at i, key j < window at j,
  key j >= window at j - 2 window."""
  i = np.arange(window)[:, None]
  j = np.arange(2 * window)[None, :]
  distance = np.where(j < window, i - j, i - j + 2 * window)
  visible = (distance >= 0) & (distance < window)
  bias = -alibi_slopes(heads)[:, None, None] * distance[None]
  return np.where(visible[None], bias, -np.inf).astype(np.float32)


def _blocks(x: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
  """x [batch, seq, h, d] (seq a multiple of window) -> (own blocks, own + previous blocks):
  [batch, blocks, window, h, d] and [batch, blocks, 2 window, h, d]."""
  batch, seq, h, d = x.shape
  own = x.reshape(batch, seq // window, window, h, d)
  previous = jnp.pad(own, ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))[:, :-1]
  return own, jnp.concatenate([own, previous], axis=2)


def alibi_window_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, scale: float | None = None, implementation: str = "xla"
) -> jax.Array:
  """Blockwise causal sliding-window attention with ALiBi (see module docstring).

  Args:
    q: [batch, seq, heads, head_dim]; k, v: [batch, seq, kv_heads, head_dim]
      (heads % kv_heads == 0); seq need not be a multiple of window.
    window: each query sees itself and the window - 1 keys before it (>= 1).
    scale: score scale, default 1/sqrt(head_dim).
    implementation: "xla" (float32 softmax, [batch, seq, heads, 2 window] scores) or
      "cudnn" (`jax.nn.dot_product_attention` on the blocks, bias in q's dtype).

  Returns:
    [batch, seq, heads, head_dim] in q's dtype.
  """
  batch, seq, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  scale = head_dim**-0.5 if scale is None else scale
  padded = -(-seq // window) * window
  pad = ((0, 0), (0, padded - seq), (0, 0), (0, 0))
  q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  blocks = padded // window
  q_blocks, _ = _blocks(q, window)
  _, k_blocks = _blocks(k, window)
  _, v_blocks = _blocks(v, window)
  bias = _block_bias(window, heads)
  # The first block has no predecessor: its keys window .. 2 window - 1 are padding.
  key_lengths = jnp.where(jnp.arange(blocks) == 0, window, 2 * window)
  if implementation == "cudnn":
    fold = lambda x: x.reshape(batch * blocks, *x.shape[2:])
    out = jax.nn.dot_product_attention(
      fold(q_blocks),
      fold(k_blocks),
      fold(v_blocks),
      bias=jnp.asarray(bias, q.dtype)[None],
      scale=scale,
      key_value_seq_lengths=jnp.tile(key_lengths, batch).astype(jnp.int32),
      implementation="cudnn",
    )
  elif implementation == "xla":
    group = heads // kv_heads
    qg = q_blocks.reshape(batch, blocks, window, kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("bnqhgd,bnkhd->bnhgqk", qg, k_blocks.astype(jnp.float32)) * scale
    scores += jnp.asarray(bias).reshape(kv_heads, group, window, 2 * window)
    has_key = jnp.arange(2 * window)[None, :] < key_lengths[:, None]  # [blocks, 2 window]
    scores = jnp.where(has_key[None, :, None, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bnhgqk,bnkhd->bnqhgd", weights, v_blocks.astype(jnp.float32)).astype(q.dtype)
  else:
    raise ValueError(f"Unknown ALiBi window attention implementation {implementation!r}; choose 'xla' or 'cudnn'")
  return out.reshape(batch, padded, heads, head_dim)[:, :seq]
