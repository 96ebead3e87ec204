"""Standard (softmax) causal attention: reference and fast paths behind one entry point,
and the fixed-capacity KV cache its decoding path attends over."""

from castle_jax.ops.attention.api import IMPLEMENTATIONS, causal_attention
from castle_jax.ops.attention.kv_cache import KVCache
from castle_jax.ops.attention.reference import causal_mask, masked_attention

__all__ = ["IMPLEMENTATIONS", "KVCache", "causal_attention", "causal_mask", "masked_attention"]
