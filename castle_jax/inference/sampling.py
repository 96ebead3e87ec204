"""Next-token sampling: greedy, temperature, top-k and nucleus (top-p)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
  if top_k < 0:
    raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {top_p}")


def validate_request(
  prompt: jax.Array, max_new_tokens: int, temperature: float, top_k: int, top_p: float, rng: jax.Array | None
) -> jax.Array:
  """Checks a generation request; returns the prompt as an int32 [batch, prompt_len] array."""
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1:
    raise ValueError(f"prompt must be int [batch, prompt_len] with prompt_len >= 1, got shape {prompt.shape}")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  validate_sampling(temperature, top_k, top_p)
  if temperature > 0 and rng is None:
    raise ValueError("rng is required when temperature > 0")
  return prompt.astype(jnp.int32)


def padded_prompt(prompt, prompt_lengths) -> tuple[Any, np.ndarray | None]:
  """Prompts of different lengths as one array: (prompt [batch, prompt_len] with each row's
  tokens first, then padding; lengths int32 [batch], or None when an array came without
  prompt_lengths) from a list of token sequences, or from an array and prompt_lengths
  (int [batch]); prompt_len is the longest row's length. ValueError on empty rows and bad
  lengths; the array itself is checked by `validate_request`."""
  if isinstance(prompt, (list, tuple)):
    if prompt_lengths is not None:
      raise ValueError(
        "prompt_lengths goes with an int [batch, prompt_len] prompt, got a list of sequences "
        "(each one's length is its own): drop prompt_lengths"
      )
    if not prompt:
      raise ValueError("prompt is an empty list: pass at least one prompt sequence")
    rows = [np.asarray(row) for row in prompt]
    for i, row in enumerate(rows):
      if row.ndim != 1 or not (row.size == 0 or np.issubdtype(row.dtype, np.integer)):
        raise ValueError(
          f"prompt row {i} must be a sequence of int token ids, got {row.dtype} of shape {row.shape}: "
          "pass a list of token lists"
        )
    lengths = np.array([row.size for row in rows], np.int32)
    _check_lengths(lengths, "len(prompt[{i}])")
    padded = np.zeros((len(rows), int(lengths.max(initial=0))), np.int32)
    for i, row in enumerate(rows):
      padded[i, : row.size] = row
    return padded, lengths
  if prompt_lengths is None:
    return prompt, None
  lengths = np.asarray(prompt_lengths)
  if lengths.shape != jnp.shape(prompt)[:1] or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(
      f"prompt_lengths must be int [batch] with batch = {jnp.shape(prompt)[:1]} (the prompt's rows), "
      f"got {lengths.dtype} of shape {lengths.shape}: one length per prompt row"
    )
  _check_lengths(lengths, "prompt_lengths[{i}]")
  if jnp.ndim(prompt) != 2:
    return prompt, lengths  # `validate_request` names the shape
  width = jnp.shape(prompt)[1]
  if (lengths > width).any():
    i = int(np.argmax(lengths > width))
    raise ValueError(
      f"prompt_lengths[{i}] = {int(lengths[i])} exceeds the prompt's {width} columns: "
      "row i's prompt is prompt[i, :prompt_lengths[i]]; pad the prompt to the longest row"
    )
  # Columns past the longest row are dropped: the result has prompt_len = the longest row.
  return jnp.asarray(prompt)[:, : int(lengths.max())], lengths.astype(np.int32)


def _check_lengths(lengths: np.ndarray, name: str) -> None:
  """ValueError naming the first length < 1 (`name` formats with its index i)."""
  if (lengths < 1).any():
    i = int(np.argmax(lengths < 1))
    raise ValueError(f"{name.format(i=i)} = {int(lengths[i])}: every prompt row needs >= 1 token; drop the empty row")


def sample_next_token(
  logits: jax.Array, rng: jax.Array, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0
) -> jax.Array:
  """Draws one token per row.

  Args:
    logits: float [batch, vocab].
    rng: PRNG key (unused when temperature == 0).
    temperature: 0 for greedy (argmax); otherwise logits are divided by it.
    top_k: keep only the k most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches
      top_p (1.0: all); the most likely token is always kept.

  Returns:
    int32 [batch].
  """
  validate_sampling(temperature, top_k, top_p)
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(rng, filtered_logits(logits, temperature, top_k, top_p), axis=-1).astype(jnp.int32)


def filtered_logits(logits: jax.Array, temperature: float, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
  """The logits whose softmax is the sampling distribution: float32 [..., vocab] divided by
  temperature (> 0), -inf outside the top_k and outside the top_p nucleus."""
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # Probability mass strictly before each sorted token; keep while it is < top_p.
    mass_before = cumulative - jax.nn.softmax(sorted_logits, axis=-1)
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return logits
