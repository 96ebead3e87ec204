"""Token embedding whose gradient accumulates in the parameters' dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.sharding import with_axes

if TYPE_CHECKING:  # layers read the config's attributes only
  from castle_jax.config import ModelConfig


class Embedding(nn.Embed):
  """`flax.linen.Embed` that gathers rows from the table in its parameter dtype and casts
  only the gathered rows to `dtype`.

  The forward values are the same as Embed's (casting a row before or after the gather
  gives the same bits). The backward differs: the gradient of a gather is a scatter-add
  of one row per token into a [vocab, d_model] table, and Embed casts the whole table
  first, so that scatter-add runs in `dtype`. Real text repeats a few hundred ids, so
  many tokens add into the same rows: in bfloat16 that is lossy (8 bits of mantissa
  per partial sum) and, on an H100, slow under contention (the Baseline-S step on real
  batches against uniform ids: benchmarks/RESULTS.md).
  Here the scatter-add runs in float32. `attend` (the tied LM head) is Embed's own
  matmul in `dtype`.
  """

  def __call__(self, inputs: jax.Array) -> jax.Array:
    """inputs: int [...] -> [..., features] in `dtype`."""
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError(f"Embedding inputs must be integer token ids, got dtype {inputs.dtype}")
    if inputs.size == 1:
      # XLA's GPU compiler turns a gather of one row into a dynamic slice before it partitions
      # the program, and a dynamic slice of a table split over the vocabulary gathers the whole
      # table onto every device (1 GiB per decoding step for Llama-3-8B on two GPUs); a gather of
      # two rows stays a gather, which each device answers from its own rows.
      twice = jnp.broadcast_to(inputs.reshape(1), (2,))
      return jnp.take(self.embedding, twice, axis=0)[:1].reshape(*inputs.shape, -1).astype(self.dtype)
    return jnp.take(self.embedding, inputs, axis=0).astype(self.dtype)


def token_embedding(config: ModelConfig, name: str | None = None) -> Embedding:
  """The model's token table [vocab, d_model] (also the tied LM head, `.attend`)."""
  return Embedding(
    config.vocab_size,
    config.d_model,
    dtype=config.compute_dtype,
    param_dtype=config.weights_dtype,
    embedding_init=with_axes(nn.initializers.normal(config.init_std), ("vocab", "embed")),
    name=name,
  )


def lm_head(config: ModelConfig, name: str | None = None) -> nn.Dense:
  """The untied LM head [d_model, vocab] (a tied head is `token_embedding(...).attend`)."""
  return nn.Dense(
    config.vocab_size,
    use_bias=False,
    dtype=config.compute_dtype,
    param_dtype=config.weights_dtype,
    kernel_init=with_axes(nn.initializers.normal(config.init_std), ("embed", "vocab")),
    name=name,
  )
