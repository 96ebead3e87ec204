"""Grouped cross attention with causal chunk retrieval (GCA, the attention of DRT)."""

from castle_jax.ops.gca.api import IMPLEMENTATIONS, KERNEL_CONFIGS, gca_attention
from castle_jax.ops.gca.xla import gca_chunked
from castle_jax.ops.gca.common import softmax_one
from castle_jax.ops.gca.reference import causal_chunk_mask, gca_reference, retrieval_scores, select_chunks

__all__ = [
  "IMPLEMENTATIONS",
  "KERNEL_CONFIGS",
  "causal_chunk_mask",
  "gca_attention",
  "gca_chunked",
  "gca_reference",
  "retrieval_scores",
  "select_chunks",
  "softmax_one",
]
