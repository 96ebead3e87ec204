"""Token embedding whose gradient accumulates in the parameters' dtype."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class Embedding(nn.Embed):
  """`flax.linen.Embed` that gathers rows from the table in its parameter dtype and casts
  only the gathered rows to `dtype`.

  The forward values are the same as Embed's (casting a row before or after the gather
  gives the same bits). The backward differs: the gradient of a gather is a scatter-add
  of one row per token into a [vocab, d_model] table, and Embed casts the whole table
  first, so that scatter-add runs in `dtype`. Real text repeats a few hundred ids, so
  many tokens add into the same rows: in bfloat16 that is lossy (8 bits of mantissa
  per partial sum) and, on an H100, slow under contention (the Baseline-S step on
  real batches took 110 ms instead of 93 ms on uniform ids; benchmarks/RESULTS.md).
  Here the scatter-add runs in float32. `attend` (the tied LM head) is Embed's own
  matmul in `dtype`.
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """inputs: int [...] -> [..., features] in `dtype`."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"Embedding inputs must be integer token ids, got dtype {inputs.dtype}")
    return jnp.take(self.embedding, inputs, axis=0).astype(self.dtype)
