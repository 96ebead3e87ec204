"""DRT: landmark layout, causality of the whole model, retrieval in training vs evaluation,
gradients reaching the retriever, bad options."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.config import ModelConfig
from castle_jax.models.drt import DRT, DRTOptions, insert_landmarks, real_positions, serve_next_chunk

CONFIG = ModelConfig(
  family="drt",
  vocab_size=64,
  d_model=32,
  n_layers=4,
  n_heads=4,
  n_kv_heads=2,
  dtype="float32",
  sliding_window=6,
  attention_kwargs=(("positions", "alibi"),),
)
OPTIONS = DRTOptions(chunk_size=4, top_k=2, encoder_layers=1)


@pytest.fixture(scope="module")
def model_and_params():
  model = DRT(CONFIG, OPTIONS)
  tokens = jnp.zeros((2, 8), jnp.int32)
  init = jax.jit(lambda tokens: model.init({"params": jax.random.key(1), "gumbel": jax.random.key(2)}, tokens))
  params = nn.unbox(init(tokens))["params"]
  return model, params


def _apply(model, train=False):
  """Jitted logits of `model` (one compile per input shape)."""
  return jax.jit(
    lambda params, tokens, rng: model.apply({"params": params}, tokens, train=train, rngs={"gumbel": rng})[0]
  )


def _tokens(seed, length=30):
  return jax.random.randint(jax.random.key(seed), (2, length), 0, CONFIG.vocab_size)


def test_landmark_layout_round_trip():
  x = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)
  with_marks = insert_landmarks(x, jnp.full((3,), -1.0), chunk_size=4)
  assert with_marks.shape == (2, 10, 3)
  np.testing.assert_array_equal(with_marks[:, 4], -1.0)
  np.testing.assert_array_equal(with_marks[:, 9], -1.0)
  np.testing.assert_array_equal(real_positions(with_marks, 4), x)
  indices, weights = serve_next_chunk(jnp.array([[[3], [5], [7]]]), jnp.array([[[0.5], [0.25], [1.0]]]))
  np.testing.assert_array_equal(indices[0, :, 0], [0, 3, 5])
  np.testing.assert_array_equal(weights[0, :, 0], [0.0, 0.5, 0.25])


@pytest.mark.parametrize("train", [False, True])
def test_whole_model_is_autoregressive(model_and_params, train):
  model, params = model_and_params
  tokens = _tokens(0)
  apply = _apply(model, train)
  logits = apply(params, tokens, jax.random.key(5))
  assert logits.shape == (2, 30, CONFIG.vocab_size)
  for t in (3, 4, 13, 29):  # chunk ends, chunk starts, the last token
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % CONFIG.vocab_size)
    other = apply(params, changed, jax.random.key(5))
    np.testing.assert_array_equal(other[:, :t], logits[:, :t])
    assert float(jnp.max(jnp.abs(other[:, t] - logits[:, t]))) > 0


def test_padding_of_the_last_chunk_changes_nothing(model_and_params):
  model, params = model_and_params
  tokens = _tokens(1, 32)
  full = _apply(model)(params, tokens, jax.random.key(0))
  prefix = _apply(model)(params, tokens[:, :27], jax.random.key(0))
  np.testing.assert_allclose(prefix, full[:, :27], rtol=1e-5, atol=1e-5)


def test_gumbel_noise_only_in_training(model_and_params):
  model, params = model_and_params
  tokens = _tokens(2, 40)
  evaluate = _apply(model)
  np.testing.assert_array_equal(
    evaluate(params, tokens, jax.random.key(0)), evaluate(params, tokens, jax.random.key(9))
  )
  train = _apply(model, train=True)
  train_runs = [train(params, tokens, jax.random.key(s)) for s in range(4)]
  assert any(float(jnp.max(jnp.abs(r - train_runs[0]))) > 0 for r in train_runs[1:])


@pytest.mark.parametrize("options", [OPTIONS, DRTOptions(chunk_size=4, top_k=2, encoder_layers=1, retriever="random")])
def test_retriever_learns_through_the_chunk_weights(model_and_params, options):
  _, params = model_and_params
  model = DRT(CONFIG, options)
  tokens = _tokens(3, 40)

  def loss(p):
    logits = model.apply({"params": p}, tokens, train=True, rngs={"gumbel": jax.random.key(4)})[0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

  grads = jax.jit(jax.grad(loss))(params)
  assert float(jnp.linalg.norm(grads["retrieval_norm_0"]["scale"])) > 0
  assert float(jnp.linalg.norm(grads["chunk_memory"]["key"]["kernel"])) > 0


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(retriever="bm25"), "retriever must be one of"),
    (dict(gumbel=1), "gumbel must be True or False"),
  ],
)
def test_bad_options_are_named(fields, message):
  with pytest.raises(ValueError, match=message):
    DRTOptions(**fields)


def test_layer_groups_must_divide():
  assert DRTOptions(retrieval_groups=2).upper_layer_groups(12) == [3, 3]
  with pytest.raises(ValueError, match="retrieval_groups"):
    DRTOptions(retrieval_groups=4).upper_layer_groups(12)


def test_family_entry_counts_parameters_and_rejects_bad_configs():
  from castle_jax.models import build_model, count_parameters, training_flops_per_token

  config = dataclasses.replace(
    CONFIG, family="drt", family_kwargs=(("chunk_size", 4), ("encoder_layers", 1), ("top_k", 2))
  )
  model = build_model(config)
  params = nn.unbox(jax.jit(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))())
  assert count_parameters(config) == sum(x.size for x in jax.tree.leaves(params))
  assert training_flops_per_token(config, 64) > 6 * count_parameters(config) - 6 * 64 * 32
  for changes, message in (
    (dict(sliding_window=0), "model.sliding_window"),
    (dict(family_kwargs=(("chunk", 4),)), r"Unknown model.family_kwargs \['chunk'\]"),
    (dict(attention_kwargs=()), "positions='alibi'"),
  ):
    with pytest.raises(ValueError, match=message):
      build_model(dataclasses.replace(config, **changes))


def test_trains_through_the_trainer_and_resumes_with_the_same_gumbel_noise(tiny_run_config):
  import copy
  import os
  import shutil

  from train.metrics import read_metrics
  from train.trainer import train

  config = tiny_run_config
  with config.unlocked():
    config.model.family = "drt"
    config.model.n_layers, config.model.sliding_window = 2, 8
    config.model.family_kwargs = dict(chunk_size=7, top_k=2, encoder_layers=1)
    config.model.attention_kwargs = dict(positions="alibi")
    config.train.steps, config.train.checkpoint_every = 6, 3
  train(config)
  # The run again from its step-3 checkpoint, in a copy of its workdir: steps 4-6 run
  # again and their records (the last record of a step wins) replace the first run's.
  resumed = copy.deepcopy(config)
  with resumed.unlocked():
    resumed.workdir = config.workdir + "_resumed"
    resumed.train.resume_step = 3
  shutil.copytree(config.workdir, resumed.workdir)
  steps_run = []
  train(resumed, after_step=steps_run.append)
  assert steps_run == [4, 5, 6]
  losses = {s: r["loss"] for s, r in read_metrics(os.path.join(config.workdir, "metrics.jsonl")).items()}
  again = {s: r["loss"] for s, r in read_metrics(os.path.join(resumed.workdir, "metrics.jsonl")).items()}
  assert losses == again and len(losses) == 6
  assert losses[6] < losses[1]


def test_bad_gca_output_is_named():
  with pytest.raises(ValueError, match=r"gca_output must be one of \('mlp_input', 'residual'\), got 'mlp'"):
    DRTOptions(gca_output="mlp")
