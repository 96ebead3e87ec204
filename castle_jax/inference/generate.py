"""Autoregressive generation with fixed-capacity caches, compiled as one program."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.inference.sampling import sample_next_token, validate_request
from castle_jax.models.registry import family_of


def generate(
  model: nn.Module,
  params: Any,
  prompt: jax.Array,
  *,
  max_new_tokens: int,
  rng: jax.Array | None = None,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  capacity: int | None = None,
) -> jax.Array:
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
  prompt = validate_request(prompt, max_new_tokens, temperature, top_k, top_p, rng)
  needed = prompt.shape[1] + max_new_tokens
  capacity = needed if capacity is None else capacity
  if needed > capacity:
    raise ValueError(
      f"prompt_len ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the cache "
      f"capacity ({capacity}); raise capacity"
    )
  rng = jax.random.key(0) if rng is None else rng
  family = family_of(model)
  if family.stream_decoder is not None:
    return _generate_streaming(
      family.stream_decoder(model, params, prompt.shape[0], capacity),
      prompt,
      rng,
      max_new_tokens,
      float(temperature),
      int(top_k),
      float(top_p),
    )
  return _generate(
    model, params, prompt.astype(jnp.int32), rng, max_new_tokens, capacity, float(temperature), int(top_k), float(top_p)
  )


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
  emitted, _ = _decode_scan(model, params, caches, first, jnp.int32(prompt_len), rng, max_new_tokens - 1, sample)
  return jnp.concatenate([prompt, first[:, None], emitted], axis=1)


def _decode_scan(model, params, caches, token, position, rng, steps: int, sample):
  """`steps` tokens after `token` (int32 [B], at `position`, not yet in the caches), one
  decode step each: (int32 [B, steps], caches)."""
  family = family_of(model)
  batch = token.shape[0]

  def step(carry, _):
    token, caches, position, rng = carry
    rng, step_rng = jax.random.split(rng)
    logits, caches = family.decode(model, params, token[:, None], jnp.full((batch, 1), position, jnp.int32), caches)
    next_token = sample(logits[:, -1], step_rng)
    return (next_token, caches, position + 1, rng), next_token

  (_, caches, _, _), emitted = jax.lax.scan(step, (token, caches, position, rng), None, length=steps)
  return emitted.T.astype(jnp.int32), caches


def prefill_caches(model: nn.Module, params: Any, tokens: jax.Array, capacity: int, *, chunk: int = 2048):
  """A model's decoding caches after tokens int [batch, L] (L may be 0), fed `chunk`
  tokens per forward so that no step holds more than chunk x capacity attention scores.
  For models with `init_cache`/`decode` (not stream decoders)."""
  family = family_of(model)
  if family.init_cache is None:
    raise ValueError(f"model family {family.name!r} has no device caches to prefill (it decodes by streaming)")
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1, got {chunk}")
  if tokens.shape[1] > capacity:
    raise ValueError(f"{tokens.shape[1]} tokens exceed the cache capacity {capacity}")
  caches = family.init_cache(model, tokens.shape[0], capacity)
  for start in range(0, tokens.shape[1], chunk):
    piece = tokens[:, start : start + chunk]
    positions = jnp.broadcast_to(jnp.arange(start, start + piece.shape[1], dtype=jnp.int32), piece.shape)
    caches = _append_to_caches(model, params, piece, positions, caches)
  return caches


@functools.partial(jax.jit, static_argnums=0)
def _append_to_caches(model, params, tokens, positions, caches):
  return family_of(model).decode(model, params, tokens, positions, caches)[1]


@functools.partial(jax.jit, static_argnums=(0, 6, 7, 8, 9))
def continue_decoding(
  model: nn.Module,
  params: Any,
  caches: Any,
  token: jax.Array,
  position: jax.Array,
  rng: jax.Array,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
):
  """Autoregressive decoding from prefilled caches, compiled as one `lax.scan`.

  Args:
    caches: holding positions 0 .. position-1 (`prefill_caches`).
    token: int32 [batch], the token at `position` (not yet in the caches: the prompt's last).
    position: int32 scalar.
    rng: PRNG key; max_new_tokens, temperature, top_k, top_p: as `generate` takes them.

  Returns:
    (int32 [batch, max_new_tokens]: the tokens after `token`, the caches).
  """
  sample = functools.partial(sample_next_token, temperature=temperature, top_k=top_k, top_p=top_p)
  return _decode_scan(
    model, params, caches, jnp.asarray(token, jnp.int32), jnp.asarray(position, jnp.int32), rng, max_new_tokens, sample
  )


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
