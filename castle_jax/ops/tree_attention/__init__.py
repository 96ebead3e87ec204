"""Hybrid tree attention for speculative decoding (LongSpec §3.3, Appendix C): drafted
tree nodes attend to the committed KV cache and, under a tree mask, to their own branch;
the two parts are computed separately and merged through their log-sum-exps."""

from castle_jax.ops.tree_attention.api import IMPLEMENTATIONS, KERNEL_CONFIGS, cache_attention, tree_attention
from castle_jax.ops.tree_attention.masks import node_depths, tree_mask_from_parents
from castle_jax.ops.tree_attention.reference import tree_attention_reference
from castle_jax.ops.tree_attention.xla import masked_tree_attention, merge_attention

__all__ = [
  "IMPLEMENTATIONS",
  "KERNEL_CONFIGS",
  "cache_attention",
  "masked_tree_attention",
  "merge_attention",
  "node_depths",
  "tree_attention",
  "tree_attention_reference",
  "tree_mask_from_parents",
]
