"""Hybrid tree attention as one Pallas (Triton) kernel: split-K over the cache plus the masked tree tile."""

from pallas_kernels.tree_attention.config import TreeAttentionTritonConfig
from pallas_kernels.tree_attention.triton import supports_head_dim, tree_attention_triton

__all__ = ["TreeAttentionTritonConfig", "supports_head_dim", "tree_attention_triton"]
