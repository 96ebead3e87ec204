"""CASTLE: causal attention with lookahead keys (and CASTLE-SWL).

Entry point `castle_attention`; oracles in `reference`; the blockwise training path
in `xla`; UQ-KV cache decoding in `decode`.
"""

from castle_jax.ops.castle.api import IMPLEMENTATIONS, KERNEL_CONFIGS, castle_attention
from castle_jax.ops.castle.xla import (
  DEFAULT_BLOCK_SIZE,
  castle_blockwise,
  castle_blockwise_prefill,
)
from castle_jax.ops.castle.decode import UQKVCache, append_tokens, decode_step, init_cache, prefill
from castle_jax.ops.castle.reference import castle_parallel, castle_recurrent, lookahead_keys

__all__ = [
  "DEFAULT_BLOCK_SIZE",
  "IMPLEMENTATIONS",
  "KERNEL_CONFIGS",
  "UQKVCache",
  "append_tokens",
  "castle_attention",
  "castle_blockwise",
  "castle_blockwise_prefill",
  "castle_parallel",
  "castle_recurrent",
  "decode_step",
  "init_cache",
  "lookahead_keys",
  "prefill",
]
