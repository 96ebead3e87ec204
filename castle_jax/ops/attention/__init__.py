"""Standard (softmax) causal attention: reference and fast paths behind one entry point."""

from castle_jax.ops.attention.api import IMPLEMENTATIONS, causal_attention
from castle_jax.ops.attention.reference import causal_mask, masked_attention

__all__ = ["IMPLEMENTATIONS", "causal_attention", "causal_mask", "masked_attention"]
