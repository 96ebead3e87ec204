"""`model.remat_policy="save_attention"`: a rematerialized block keeps the attention ops'
residuals, so the attention forward kernels run once per step instead of twice, and the
gradients are those of `recompute_all`."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.config import ModelConfig
from castle_jax.models.drt import DRT, DRTOptions
from castle_jax.models.transformer import TransformerLM
from pallas_kernels.castle.mosaic import castle_attention_mosaic
from pallas_kernels.residuals import save_attention_residuals
from helpers import assert_close, mosaic_kernels_lowered_for_h100

_BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, dtype="float32", remat=True)
_MODELS = {
  "castle_triton": dict(attention="castle", attention_impl="triton", attention_kwargs=(("block_size", 8),)),
  "castle_swl_xla": dict(
    attention="castle_swl", attention_impl="xla", attention_kwargs=(("block_size", 4), ("lookahead_window", 3))
  ),
  "power_triton": dict(attention="power", attention_impl="triton", attention_kwargs=(("chunk_size", 64),)),
}


def _value_and_grad(model, tokens, rngs=None):
  def loss(params):
    logits = model.apply({"params": params}, tokens, rngs=rngs)[0]
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  return jax.jit(jax.value_and_grad(loss))


def _loops(compiled_text: str) -> int:
  # Every kernel (interpreted on CPU) and every scan of the XLA paths compiles to a while
  # loop; XLA drops a recomputed forward that no gradient reads.
  return compiled_text.count(" while(")


def _check_policies(build, config, params, tokens, rngs=None):
  """The three remat settings of one model: equal losses and gradients; the saving policy's
  compiled step has the loops of the step without remat, fewer than recompute_all's."""
  settings = (dict(remat=False), dict(remat=True), dict(remat=True, remat_policy="save_attention"))
  steps = [
    _value_and_grad(build(dataclasses.replace(config, **s)), tokens, rngs).lower(params).compile() for s in settings
  ]
  (plain_loss, plain_grads), (loss, grads), (saving_loss, saving_grads) = (step(params) for step in steps)
  np.testing.assert_allclose(saving_loss, loss, rtol=1e-6)
  assert_close(saving_grads, grads, 1e-5)
  assert_close(saving_grads, plain_grads, 1e-5)
  plain, recompute_all, saving = (_loops(step.as_text()) for step in steps)
  assert saving == plain < recompute_all, (plain, recompute_all, saving)


@pytest.mark.parametrize("variant", sorted(_MODELS))
def test_saving_attention_residuals_keeps_the_gradients_and_skips_the_second_forward(variant):
  # One rematerialized block: the policy acts on each block alone.
  config = ModelConfig(**{**_BASE, "n_layers": 1}, **_MODELS[variant])
  tokens = jax.random.randint(jax.random.key(0), (1, 64 if "power" in variant else 16), 0, config.vocab_size)
  params = nn.unbox(jax.jit(TransformerLM(config).init)(jax.random.key(1), tokens))["params"]
  _check_policies(TransformerLM, config, params, tokens)


def test_drt_blocks_save_the_gca_residuals():
  config = ModelConfig(
    family="drt",
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    dtype="float32",
    sliding_window=6,
    remat=True,
    attention_kwargs=(("positions", "alibi"),),
  )
  options = DRTOptions(chunk_size=4, top_k=2, encoder_layers=1)
  tokens = jax.random.randint(jax.random.key(0), (2, 30), 0, config.vocab_size)
  rngs = {"gumbel": jax.random.key(2)}
  init = jax.jit(DRT(config, options).init)
  params = nn.unbox(init({"params": jax.random.key(1), "gumbel": jax.random.key(2)}, tokens))["params"]
  _check_policies(lambda c: DRT(c, options), config, params, tokens, rngs)


def test_mosaic_castle_forward_kernels_run_once_under_the_policy():
  """Lowered for an H100 on CPU: with the policy, the rematerialized value-and-grad has the
  kernels of one forward and the backward, as without remat."""
  keys = jax.random.split(jax.random.key(0), 6)
  inputs = tuple(jax.random.normal(k, (1, 128, 2, 64), jnp.float32).astype(jnp.bfloat16) for k in keys)
  loss = lambda *a: jnp.sum(jnp.tanh(castle_attention_mosaic(*a, interpret=False).astype(jnp.float32)))
  argnums = tuple(range(6))
  plain, recompute_all, saving = mosaic_kernels_lowered_for_h100(
    (
      jax.value_and_grad(loss, argnums=argnums),
      jax.value_and_grad(jax.checkpoint(loss), argnums=argnums),
      jax.value_and_grad(jax.checkpoint(loss, policy=save_attention_residuals()), argnums=argnums),
    ),
    inputs,
  )
  assert saving == plain < recompute_all, (plain, recompute_all, saving)


def test_bad_remat_policy_is_reported():
  with pytest.raises(ValueError, match=r"model.remat_policy must be one of \('recompute_all', 'save_attention'\)"):
    ModelConfig(**_BASE, remat_policy="dots")


@pytest.mark.parametrize("family", ["transformer", "drt"])
def test_recomputed_forward_is_fenced_from_the_original(family):
  """Unscanned blocks need jax.checkpoint's prevent_cse: without the optimization barrier
  XLA merges the recomputed forward with the original on one GPU (remat then saves nothing),
  while a device mesh's shard_map keeps it (measured: 25% more attention work on 2 GPUs)."""
  config = ModelConfig(**_BASE, attention="mha")
  tokens = jax.random.randint(jax.random.key(0), (1, 16), 0, config.vocab_size)
  if family == "drt":
    config = dataclasses.replace(
      config, family="drt", n_layers=4, sliding_window=6, attention_kwargs=(("positions", "alibi"),)
    )
    build, rngs = (lambda c: DRT(c, DRTOptions(chunk_size=4, top_k=2, encoder_layers=1))), {"gumbel": jax.random.key(2)}
    tokens = jnp.tile(tokens, (1, 2))
  else:
    build, rngs = TransformerLM, None
  init_rngs = {"params": jax.random.key(1), **(rngs or {})}
  params = nn.unbox(jax.jit(build(config).init)(init_rngs, tokens))["params"]
  barriers = [
    _value_and_grad(build(dataclasses.replace(config, remat=remat)), tokens, rngs)
    .lower(params)
    .as_text()
    .count("optimization_barrier")
    for remat in (False, True)
  ]
  assert barriers[0] == 0 and barriers[1] >= config.n_layers, barriers
