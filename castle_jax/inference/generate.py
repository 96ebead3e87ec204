"""Autoregressive generation with fixed-capacity caches, compiled as one program."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.inference.sampling import padded_prompt, sample_next_token, validate_request
from castle_jax.models.registry import family_of
from castle_jax.ops.attention import KVCache


def generate(
  model: nn.Module,
  params: Any,
  prompt: jax.Array | list,
  *,
  max_new_tokens: int,
  prompt_lengths: Any = None,
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
    prompt: int [batch, prompt_len], prompt_len >= 1, or a list of token sequences of any
      lengths >= 1. Rows of different lengths need a model whose caches are all `KVCache`
      (an `mha` transformer): each row keeps its own positions and cache length, and equals
      its generation alone.
    max_new_tokens: number of tokens to append (>= 1).
    prompt_lengths: with an int [batch, prompt_len] prompt, int [batch]: row i's prompt is
      prompt[i, :prompt_lengths[i]] (the rest is padding, ignored); None: all of it.
    rng: PRNG key for sampling (required when temperature > 0).
    temperature, top_k, top_p: see `sample_next_token`.
    capacity: cache size in tokens; default prompt_len + max_new_tokens.

  Returns:
    int32 [batch, prompt_len + max_new_tokens]: the prompt followed by the new tokens; for
    rows of different lengths prompt_len is the longest, and row i holds its prompt, its
    new tokens, then zeros.
  """
  prompt, lengths = padded_prompt(prompt, prompt_lengths)
  prompt = validate_request(prompt, max_new_tokens, temperature, top_k, top_p, rng)
  if lengths is not None and (lengths == prompt.shape[1]).all():
    lengths = None  # every row fills the prompt: no per-row lengths needed
  needed = prompt.shape[1] + max_new_tokens
  capacity = needed if capacity is None else capacity
  if needed > capacity:
    raise ValueError(
      f"prompt_len ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the cache "
      f"capacity ({capacity}); raise capacity"
    )
  rng = jax.random.key(0) if rng is None else rng
  family = family_of(model)
  if lengths is not None:
    caches = jax.eval_shape(lambda: family.init_cache(model, 1, capacity)) if family.init_cache else None
    leaves = jax.tree.leaves(caches, is_leaf=lambda x: isinstance(x, KVCache))
    if caches is None or not all(isinstance(cache, KVCache) for cache in leaves):
      raise ValueError(
        f"prompt rows have different lengths {sorted(set(lengths.tolist()))}, which needs a model whose "
        f"decoding caches are KV caches (an `mha` transformer), not model family {family.name!r} with "
        f"attention {getattr(model.config, 'attention', None)!r}: call generate once per prompt length"
      )
    lengths = jnp.asarray(lengths)
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
    model,
    params,
    prompt.astype(jnp.int32),
    lengths,
    rng,
    max_new_tokens,
    capacity,
    float(temperature),
    int(top_k),
    float(top_p),
  )


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7, 8, 9))
def _generate(model, params, prompt, lengths, rng, max_new_tokens, capacity, temperature, top_k, top_p):
  """lengths: None (every row fills prompt_len) or int32 [batch], each row's prompt length."""
  family = family_of(model)
  batch, prompt_len = prompt.shape
  caches = family.init_cache(model, batch, capacity)
  positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), prompt.shape)
  logits, caches = family.decode(model, params, prompt, positions, caches)
  if lengths is None:
    last, position = logits[:, -1], jnp.int32(prompt_len)
  else:
    # A row's pad columns come after its tokens (causal attention keeps them out of the row's
    # entries); with the row's own cache length they are empty slots, overwritten as it decodes.
    caches = jax.tree.map(lambda cache: cache.replace(length=lengths), caches, is_leaf=lambda x: isinstance(x, KVCache))
    last, position = logits[jnp.arange(batch), lengths - 1], lengths
  sample = functools.partial(sample_next_token, temperature=temperature, top_k=top_k, top_p=top_p)
  rng, step_rng = jax.random.split(rng)
  first = sample(last, step_rng)
  emitted, _ = _decode_scan(model, params, caches, first, position, rng, max_new_tokens - 1, sample)
  new_tokens = jnp.concatenate([first[:, None], emitted], axis=1)
  if lengths is None:
    return jnp.concatenate([prompt, new_tokens], axis=1)
  return append_new_tokens(prompt, lengths, new_tokens)


def decode_token(model, params, caches, token, position, rng, sample):
  """One autoregressive step: `token` (int32 [B], at `position`, int32 scalar or [B], not
  yet in the caches) through the model -> (the next token sampled by `sample(logits, rng)`,
  the caches holding `token`)."""
  positions = jnp.broadcast_to(position, token.shape)[:, None]
  logits, caches = family_of(model).decode(model, params, token[:, None], positions, caches)
  return sample(logits[:, -1], rng), caches


def _decode_scan(model, params, caches, token, position, rng, steps: int, sample):
  """`steps` tokens after `token` (int32 [B], at `position`, int32 scalar or [B], not yet in
  the caches), one decode step each: (int32 [B, steps], caches)."""

  def step(carry, _):
    token, caches, position, rng = carry
    rng, step_rng = jax.random.split(rng)
    next_token, caches = decode_token(model, params, caches, token, position, step_rng, sample)
    return (next_token, caches, position + 1, rng), next_token

  (_, caches, _, _), emitted = jax.lax.scan(step, (token, caches, position, rng), None, length=steps)
  return emitted.T.astype(jnp.int32), caches


def append_new_tokens(prompt, lengths, new_tokens):
  """int32 [batch, prompt_len + new]: row i's prompt[i, :lengths[i]], its new tokens, then zeros."""
  prompt_len, new = prompt.shape[1], new_tokens.shape[1]
  columns = jnp.arange(prompt_len + new)
  lengths = jnp.asarray(lengths)[:, None]
  # Column c of a row holds prompt column c before the row's length, else new token c - length,
  # which sits at column prompt_len + c - length of [prompt ; new].
  source = jnp.where(columns < lengths, columns, prompt_len + columns - lengths)
  joined = jnp.concatenate([prompt, new_tokens], axis=1)
  picked = jnp.take_along_axis(joined, jnp.minimum(source, prompt_len + new - 1), axis=1)
  return jnp.where(columns < lengths + new, picked, 0)


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
