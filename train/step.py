"""The loss, the jitted train step (with gradient accumulation) and the eval step."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from castle_jax.eval.perplexity import loss_sums
from castle_jax.models import family_of
from train.state import TrainState, with_seed_axis


def token_losses(model: nn.Module, params: Any, batch: dict[str, jax.Array], pad_id: int, rng: jax.Array | None = None):
  """Per-token loss and weights of the model's family (`castle_jax.models.registry`).

  Args:
    batch: {"inputs": int [B, T], "targets": int [B, T]}.
    rng: a PRNG key in training (for the models that draw noise, e.g. DRT's Gumbel
      top-k), None in evaluation.

  Returns:
    (loss float32 [B, T] already weighted, weights float32 [B, T]; 0 at PAD targets).
  """
  return family_of(model).token_losses(model, params, batch, pad_id, rng)


def _microbatches(batch: dict[str, jax.Array], count: int) -> dict[str, jax.Array]:
  """[B, ...] -> [count, B/count, ...] taking rows i, i+count, ... so that each
  microbatch is spread over the same devices as the batch (no communication)."""

  def split(x):
    return x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)

  return jax.tree.map(split, batch)


def with_frozen(params: Any, frozen: dict[str, Any] | None) -> Any:
  """The parameter tree the loss sees: the trained parameters and the family's frozen
  ones (`ModelFamily.frozen_source`, e.g. a LongSpec draft's target)."""
  return params if not frozen else {**params, **frozen}


def train_step(
  state: TrainState,
  batch: dict[str, jax.Array],
  frozen: dict[str, Any] | None = None,
  *,
  model: nn.Module,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  pad_id: int,
  grad_accum_steps: int = 1,
  seed: int = 0,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update on the mean token loss of the whole (global) batch.

  The model's training noise (if any) comes from key(seed) folded with the step and the
  microbatch, so a resumed run draws the same noise as an uninterrupted one. `frozen`:
  parameters the loss reads but the update never changes (no gradient is taken).
  """
  step_rng = jax.random.fold_in(jax.random.key(seed), state.step)

  def summed_loss(params, micro, rng):
    nll, weights = token_losses(model, with_frozen(params, frozen), micro, pad_id, rng)
    return jnp.sum(nll), jnp.sum(weights)

  value_and_grad = jax.value_and_grad(summed_loss, has_aux=True)
  if grad_accum_steps == 1:
    (loss_sum, count), grads = value_and_grad(state.params, batch, step_rng)
  else:

    def accumulate(carry, micro_and_index):
      loss_sum, count, grads = carry
      micro, index = micro_and_index
      (micro_loss, micro_count), g = value_and_grad(state.params, micro, jax.random.fold_in(step_rng, index))
      return (loss_sum + micro_loss, count + micro_count, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (loss_sum, count, grads), _ = jax.lax.scan(
      accumulate,
      (jnp.float32(0), jnp.float32(0), zeros),
      (_microbatches(batch, grad_accum_steps), jnp.arange(grad_accum_steps)),
    )

  count = jnp.maximum(count, 1.0)
  grads = jax.tree.map(lambda g: g / count, grads)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {
    "loss": loss_sum / count,
    "grad_norm": optax.global_norm(grads),
    "learning_rate": schedule(state.step),
    "tokens": count,
    # What throughput counts: every input position the model ran on. `tokens` (the
    # scored targets) is far smaller when only some targets count (passkey answers).
    "input_tokens": jnp.float32(batch["inputs"].size),
  }
  return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(
  params: Any,
  batch: dict[str, jax.Array],
  *,
  model: nn.Module,
  pad_id: int,
  token_byte_lengths: jax.Array,
  microbatches: int = 1,
) -> dict[str, jax.Array]:
  """Sums for validation: nll (nats), scored tokens and the UTF-8 bytes they stand for
  (`castle_jax.eval.perplexity.loss_sums`, which the evaluation commands use too).

  `microbatches` splits the batch as the train step does, so that evaluation never holds
  more logits than one training microbatch (a whole 256 x 2048 batch of a 50K vocabulary
  would be 105 GB of float32 logits).
  """
  sums = functools.partial(loss_sums, model, params, pad_id=pad_id, token_byte_lengths=token_byte_lengths)

  if microbatches == 1:
    return sums(batch)
  per_micro = jax.lax.map(sums, _microbatches(batch, microbatches))
  return jax.tree.map(jnp.sum, per_micro)


def jit_train_step(
  *,
  model: nn.Module,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  pad_id: int,
  grad_accum_steps: int,
  state_shardings: TrainState,
  batch_sharding: jax.sharding.Sharding,
  seed: int = 0,
  frozen: dict[str, Any] | None = None,
):
  """`train_step` compiled with explicit in/out shardings; the old state is donated.
  Called as step(state, batch); `frozen` (already placed) is passed as an argument of
  the compiled step, never baked into it as constants."""
  step = functools.partial(
    train_step, model=model, tx=tx, schedule=schedule, pad_id=pad_id, grad_accum_steps=grad_accum_steps, seed=seed
  )
  frozen_shardings = jax.tree.map(lambda x: x.sharding, frozen)
  compiled = jax.jit(
    step,
    in_shardings=(state_shardings, batch_sharding, frozen_shardings),
    out_shardings=(state_shardings, None),
    donate_argnums=0,
  )
  return lambda state, batch: compiled(state, batch, frozen)


def jit_seeds_train_step(
  *,
  model: nn.Module,
  tx: optax.GradientTransformation,
  schedule: optax.Schedule,
  pad_id: int,
  grad_accum_steps: int,
  state_shardings: TrainState,
  batch_sharding: jax.sharding.NamedSharding,
):
  """`train_step` vmapped over a leading seed axis, jitted: step(state, batch, seeds) with
  seed k's state, its batch (the batch is [seeds, B, T]) and its noise seed `seeds[k]` (int32
  [seeds]). The shardings given are one run's: the seed axis stays unsharded, every other
  axis is sharded as for one run. The old state is donated."""

  def one_seed(state, batch, seed):
    return train_step(
      state, batch, model=model, tx=tx, schedule=schedule, pad_id=pad_id, grad_accum_steps=grad_accum_steps, seed=seed
    )

  stacked = with_seed_axis(state_shardings)
  return jax.jit(
    jax.vmap(one_seed),
    in_shardings=(stacked, with_seed_axis(batch_sharding), None),
    out_shardings=(stacked, None),
    donate_argnums=0,
  )
