"""Next-token sampling: greedy, temperature, top-k and nucleus (top-p)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
