"""Hybrid tree attention as one Pallas (Triton) kernel: split-K over the cache plus the masked tree tile."""

from pallas_kernels.tree_attention.config import TreeAttentionConfig
from pallas_kernels.tree_attention.kernels import supports_head_dim, tree_attention_pallas

__all__ = ["TreeAttentionConfig", "supports_head_dim", "tree_attention_pallas"]
