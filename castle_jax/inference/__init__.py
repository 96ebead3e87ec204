"""Decoding: sampling, generate(), speculative_generate() (LongSpec) and trace_speculation() (its
rounds one by one, for inspection). The caches live next to their ops (KVCache in
castle_jax.ops.attention, UQKVCache in castle_jax.ops.castle, PowerCache in
castle_jax.ops.power); KVCache is re-exported here for convenience."""

from castle_jax.inference.generate import continue_decoding, generate, prefill_caches
from castle_jax.inference.sampling import sample_next_token
from castle_jax.inference.speculative import (
  DraftedRound,
  SpeculativeResult,
  SpeculativeTrace,
  speculative_generate,
  trace_speculation,
)
from castle_jax.ops.attention import KVCache

__all__ = [
  "DraftedRound",
  "KVCache",
  "SpeculativeResult",
  "SpeculativeTrace",
  "continue_decoding",
  "generate",
  "prefill_caches",
  "sample_next_token",
  "speculative_generate",
  "trace_speculation",
]
