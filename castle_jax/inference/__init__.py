"""Decoding: caches, sampling and generate()."""

from castle_jax.inference.generate import generate
from castle_jax.inference.kv_cache import KVCache
from castle_jax.inference.sampling import sample_next_token

__all__ = ["KVCache", "generate", "sample_next_token"]
