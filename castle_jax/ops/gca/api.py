"""Grouped cross attention (GCA): the one public entry point.

`implementation`:
  - "reference": every retrieved chunk's scores materialized at once (plain jnp,
    autodiff); a test oracle.
  - "xla": one retrieved chunk at a time with a custom VJP that keeps only per-chunk
    log-normalizers (`chunked.py`); memory O(T (d + k)) for the backward.
  - None: "xla" (`castle_jax.ops.backend.choose`, logged at debug level).
"""

from __future__ import annotations

import jax

from castle_jax.ops.backend import Implementation, choose
from castle_jax.ops.gca.chunked import gca_chunked
from castle_jax.ops.gca.reference import gca_reference

IMPLEMENTATIONS = ("reference", "xla")
_DEFAULT_ORDER = ("xla",)


def gca_attention(q: jax.Array, chunk_k: jax.Array, chunk_v: jax.Array, chunk_weights: jax.Array,
                  chunk_indices: jax.Array, *, scale: float | None = None,
                  implementation: str | None = None) -> jax.Array:
  """Each query chunk attends to its k retrieved memory chunks, separately, and mixes them.

  out[b, c*L + i, h] = sum_j chunk_weights[b, c, j] * softmax_1(q[b, c*L + i, h] .
      chunk_k[b, idx, :, h // group]^T * scale) chunk_v[b, idx, :, h // group],
  idx = chunk_indices[b, c, j], L = seq // query_chunks, group = heads // kv_heads,
  softmax_1(z)_s = exp(z_s) / (1 + sum_s' exp(z_s')).

  Args:
    q: [batch, seq, heads, head_dim]; seq = query_chunks * L, token c*L + i is row i of
      query chunk c.
    chunk_k, chunk_v: [batch, memory_chunks, chunk_len, kv_heads, head_dim], the memory
      chunks' keys and values (heads % kv_heads == 0).
    chunk_weights: float [batch, query_chunks, k], the weight of each retrieved chunk
      (e.g. `select_chunks`' softmax of the retrieval scores; 0 for an empty slot).
      Differentiable: the retriever learns through it.
    chunk_indices: int [batch, query_chunks, k] in [0, memory_chunks), which memory
      chunk each slot holds (out-of-range indices are clipped). No gradient.
    scale: score scale, default 1/sqrt(head_dim).
    implementation: one of IMPLEMENTATIONS or None (see module docstring).

  Returns:
    [batch, seq, heads, head_dim] in q's dtype (bf16 inputs are computed in float32).

  Raises:
    ValueError: bad shapes or dtypes (naming the argument), seq not a multiple of the
      query chunks, k < 1, unknown implementation.
  """
  implementation = choose("gca_attention", implementation, {name: Implementation() for name in IMPLEMENTATIONS},
                          _DEFAULT_ORDER)
  run = gca_reference if implementation == "reference" else gca_chunked
  return run(q, chunk_k, chunk_v, chunk_weights, chunk_indices, scale=scale)
