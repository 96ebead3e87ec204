"""Autoregressive generation with fixed-capacity caches, compiled as one program."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.inference.sampling import sample_next_token, validate_sampling
from castle_jax.models.registry import family_of


def generate(model: nn.Module, params: Any, prompt: jax.Array, *, max_new_tokens: int,
             rng: jax.Array | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, capacity: int | None = None) -> jax.Array:
  """Continues each prompt by `max_new_tokens` tokens.

  The prompt is run through the model once (prefill, filling each layer's cache),
  then one token at a time with the caches. With temperature 0 the result equals
  repeatedly taking the argmax of the parallel forward pass. Models with caches on the
  device decode as one compiled program; a family with a `stream_decoder` (DRT, whose
  chunk memory lives in host RAM) is driven token by token from Python.

  Args:
    model: a module built from a ModelConfig (`castle_jax.models.build_model`); its
      family (`castle_jax.models.registry`) supplies init_cache and decode.
    params: its parameters (the "params" collection, unboxed).
    prompt: int [batch, prompt_len], prompt_len >= 1; all rows the same length.
    max_new_tokens: number of tokens to append (>= 1).
    rng: PRNG key for sampling (required when temperature > 0).
    temperature, top_k, top_p: see `sample_next_token`.
    capacity: cache size in tokens; default prompt_len + max_new_tokens.

  Returns:
    int32 [batch, prompt_len + max_new_tokens]: the prompt followed by the new tokens.
  """
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be int [batch, prompt_len] with prompt_len >= 1, got shape {prompt.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  validate_sampling(temperature, top_k, top_p)
  if temperature > 0 and rng is None:
    raise ValueError("rng is required when temperature > 0")
  needed = prompt.shape[1] + max_new_tokens
  capacity = needed if capacity is None else capacity
  if needed > capacity:
    raise ValueError(
        f"prompt_len ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the cache "
        f"capacity ({capacity}); raise capacity")
  rng = jax.random.key(0) if rng is None else rng
  family = family_of(model)
  if family.stream_decoder is not None:
    return _generate_streaming(family.stream_decoder(model, params, prompt.shape[0], capacity), prompt, rng,
                               max_new_tokens, float(temperature), int(top_k), float(top_p))
  return _generate(model, params, prompt.astype(jnp.int32), rng, max_new_tokens, capacity,
                   float(temperature), int(top_k), float(top_p))


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 7, 8))
def _generate(model, params, prompt, rng, max_new_tokens, capacity, temperature, top_k, top_p):
  family = family_of(model)
  batch, prompt_len = prompt.shape
  caches = family.init_cache(model, batch, capacity)
  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt.shape)
  logits, caches = family.decode(model, params, prompt, positions, caches)
  sample = functools.partial(sample_next_token, temperature=temperature, top_k=top_k, top_p=top_p)
  rng, step_rng = jax.random.split(rng)
  first = sample(logits[:, -1], step_rng)

  def step(carry, _):
    token, caches, position, rng = carry
    rng, step_rng = jax.random.split(rng)
    logits, caches = family.decode(model, params, token[:, None], jnp.full((batch, 1), position, jnp.int32), caches)
    next_token = sample(logits[:, -1], step_rng)
    return (next_token, caches, position + 1, rng), token

  (last, _, _, _), emitted = jax.lax.scan(
      step, (first, caches, jnp.int32(prompt_len), rng), None, length=max_new_tokens - 1)
  new_tokens = jnp.concatenate([emitted.T, last[:, None]], axis=1)
  return jnp.concatenate([prompt, new_tokens], axis=1)


def _generate_streaming(stream, prompt, rng, max_new_tokens, temperature, top_k, top_p):
  sample = jax.jit(functools.partial(sample_next_token, temperature=temperature, top_k=top_k, top_p=top_p))
  logits = stream.feed(prompt)
  new_tokens = []
  for step in range(max_new_tokens):
    rng, step_rng = jax.random.split(rng)
    new_tokens.append(sample(logits[:, -1], step_rng).astype(jnp.int32))
    if step + 1 < max_new_tokens:
      logits = stream.feed(new_tokens[-1][:, None])
  return jnp.concatenate([prompt, jnp.stack(new_tokens, axis=1)], axis=1)
