"""Standard (softmax) causal attention: reference and fast paths behind one entry point,
and the KV caches its decoding path attends over (fixed capacity, or a ring of the
last positions for sliding windows)."""

from castle_jax.ops.attention.api import IMPLEMENTATIONS, causal_attention
from castle_jax.ops.attention.kv_cache import KVCache, WindowKVCache
from castle_jax.ops.attention.reference import causal_mask, masked_attention

__all__ = ["IMPLEMENTATIONS", "KVCache", "WindowKVCache", "causal_attention", "causal_mask", "masked_attention"]
