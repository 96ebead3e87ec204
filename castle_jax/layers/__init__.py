"""Flax linen building blocks: norms, RoPE, SwiGLU and the attention registry."""
