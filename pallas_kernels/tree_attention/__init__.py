"""Hybrid tree attention as Pallas kernels: split-K over the cache plus the masked tree tile,
on Triton (any CUDA GPU) and on Mosaic GPU (Hopper)."""

from pallas_kernels.tree_attention.config import TreeAttentionMosaicConfig, TreeAttentionTritonConfig
from pallas_kernels.tree_attention.mosaic import tree_attention_mosaic
from pallas_kernels.tree_attention.mosaic import unsupported_reason as mosaic_unsupported_reason
from pallas_kernels.tree_attention.triton import supports_head_dim, tree_attention_triton

__all__ = [
  "TreeAttentionMosaicConfig",
  "TreeAttentionTritonConfig",
  "mosaic_unsupported_reason",
  "supports_head_dim",
  "tree_attention_mosaic",
  "tree_attention_triton",
]
