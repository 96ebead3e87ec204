"""Power attention: (q . k)^p attention = linear attention with a symmetric-power state.

Entry point `power_attention`; state expansions in `expansion`; the attention-form
oracles in `reference`; the chunked XLA path in `xla`; decoding with a constant-size
state in `decode`.
"""

from castle_jax.ops.power.api import IMPLEMENTATIONS, KERNEL_CONFIGS, power_attention, resolve
from castle_jax.ops.power.xla import empty_state, power_attention_chunked
from castle_jax.ops.power.common import DEFAULT_CHUNK_SIZE, PowerState
from castle_jax.ops.power.expansion import EXPANSIONS, expand, expanded_dim, spow, tpow, tspow
from castle_jax.ops.power.decode import (
  PowerCache,
  append_tokens,
  decode_step,
  init_cache,
  power_attention_recurrent,
  prefill,
)
from castle_jax.ops.power.reference import power_attention_log_space, power_attention_reference, reference_state

__all__ = [
  "DEFAULT_CHUNK_SIZE",
  "EXPANSIONS",
  "IMPLEMENTATIONS",
  "KERNEL_CONFIGS",
  "PowerCache",
  "PowerState",
  "append_tokens",
  "decode_step",
  "empty_state",
  "expand",
  "expanded_dim",
  "init_cache",
  "power_attention",
  "power_attention_chunked",
  "power_attention_log_space",
  "power_attention_recurrent",
  "power_attention_reference",
  "prefill",
  "reference_state",
  "resolve",
  "spow",
  "tpow",
  "tspow",
]
