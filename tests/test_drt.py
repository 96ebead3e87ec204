"""DRT: landmark layout, causality of the whole model, retrieval in training vs evaluation,
the random-retriever control, gradients reaching the retriever and GCA, bad options."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.config import ModelConfig
from castle_jax.models.drt import DRT, DRTOptions, insert_landmarks, real_positions, select, serve_next_chunk
from castle_jax.ops.gca import retrieval_scores

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
RANDOM = dataclasses.replace(OPTIONS, retriever="random")


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


@pytest.mark.parametrize("options", [OPTIONS, RANDOM], ids=["learned", "random"])
@pytest.mark.parametrize("train", [False, True])
def test_whole_model_is_autoregressive(model_and_params, train, options):
  _, params = model_and_params
  model = DRT(CONFIG, options)
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


@pytest.mark.parametrize("options", [OPTIONS, RANDOM], ids=["learned", "random"])
def test_gumbel_noise_only_in_training(model_and_params, options):
  """Evaluation ignores the rng (the random retriever draws from its fixed key); training
  draws other chunks for other keys."""
  _, params = model_and_params
  model = DRT(CONFIG, options)
  tokens = _tokens(2, 40)
  evaluate = _apply(model)
  np.testing.assert_array_equal(
    evaluate(params, tokens, jax.random.key(0)), evaluate(params, tokens, jax.random.key(9))
  )
  train = _apply(model, train=True)
  train_runs = [train(params, tokens, jax.random.key(s)) for s in range(4)]
  assert any(float(jnp.max(jnp.abs(r - train_runs[0]))) > 0 for r in train_runs[1:])


@pytest.mark.parametrize("options", [OPTIONS, RANDOM], ids=["learned", "random"])
def test_retriever_and_gca_learn_through_the_chunk_weights(model_and_params, options):
  """The random retriever keeps GCA learnable: its queries, output and the shared memory
  projections get gradients, and so do the relevance scores through the chunk weights."""
  _, params = model_and_params
  model = DRT(CONFIG, options)
  tokens = _tokens(3, 40)

  def loss(p):
    logits = model.apply({"params": p}, tokens, train=True, rngs={"gumbel": jax.random.key(4)})[0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

  grads = jax.jit(jax.grad(loss))(params)
  assert float(jnp.linalg.norm(grads["retrieval_norm_0"]["scale"])) > 0
  for path in (
    "chunk_memory/key",
    "chunk_memory/value",
    "block_2/cross_attention/query",
    "block_3/cross_attention/out",
  ):
    grad = grads
    for name in path.split("/"):
      grad = grad[name]
    assert float(jnp.linalg.norm(grad["kernel"])) > 0, path


def _scores(seed, batch=2, chunks=12, dim=8):
  """Relevance scores [batch, chunks, chunks] of random landmark states (-inf unless c < t)."""
  queries, landmarks = jax.random.normal(jax.random.key(seed), (2, batch, chunks, dim))
  return retrieval_scores(queries, landmarks)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_random_retriever_picks_earlier_chunks_whatever_their_scores(train):
  """Only earlier chunks, min(t, k) distinct ones, weighted by the softmax of their own
  scores; other scores (the same causal mask) give the same choice."""
  scores = _scores(0)
  rng = jax.random.key(3) if train else None
  indices, weights = select(RANDOM, scores, 3, rng)
  indices, weights, scores_np = np.asarray(indices), np.asarray(weights), np.asarray(scores)
  for b, t in np.ndindex(2, 12):
    used = indices[b, t][weights[b, t] > 0]
    assert len(set(used.tolist())) == len(used) == min(t, 3), (b, t, indices[b, t], weights[b, t])
    assert np.all(used < t)
    chosen = scores_np[b, t, used]
    np.testing.assert_allclose(weights[b, t][weights[b, t] > 0], np.exp(chosen) / np.exp(chosen).sum(), rtol=1e-5)
  np.testing.assert_allclose(weights.sum(-1), np.minimum(np.arange(12), 1)[None].repeat(2, 0), rtol=1e-5)
  np.testing.assert_array_equal(select(RANDOM, _scores(1), 3, rng)[0], indices)
  learned = np.asarray(select(OPTIONS, scores, 3, None)[0])
  assert not np.array_equal(learned, indices)  # the learned one follows the scores


def test_random_retriever_draws_a_uniform_subset_per_key():
  """In training each key draws its own chunks, every earlier chunk about equally often."""
  scores = _scores(0, batch=1, chunks=11)
  keys = jax.random.split(jax.random.key(0), 500)
  draws = np.asarray(jax.vmap(lambda key: select(RANDOM, scores, 2, key)[0][0, 10])(keys))
  counts = np.bincount(draws.ravel(), minlength=11)
  assert counts[10] == 0 and counts.sum() == 1000
  assert 60 < counts[:10].min() and counts[:10].max() < 140  # 100 expected, binomial sd 9.5
  assert len({tuple(sorted(d)) for d in draws.tolist()}) > 30  # of the 45 possible pairs


def test_random_retriever_outside_training_is_keyed_by_position():
  """Without an rng the draw depends on (group, query chunk, memory chunk) only: the same in
  every batch row, not the first k chunks, the same when the memory is wider and the rows
  are numbered from a later chunk (as the streaming decoder scores), other for another group."""
  scores = _scores(0)
  indices = np.asarray(select(RANDOM, scores, 3, None)[0])
  np.testing.assert_array_equal(indices[0], indices[1])
  assert any(set(indices[0, t].tolist()) != {0, 1, 2} for t in range(4, 12))
  wide = jnp.pad(scores[:, 5:9], ((0, 0), (0, 0), (0, 20)), constant_values=-jnp.inf)
  np.testing.assert_array_equal(select(RANDOM, wide, 3, None, query_chunks=jnp.arange(5, 9))[0], indices[:, 5:9])
  assert not np.array_equal(select(RANDOM, scores, 3, None, group=1)[0], indices)


@pytest.mark.parametrize(
  "fields, message",
  [
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(retriever="bm25"), r"retriever must be one of \('learned', 'random'\), got 'bm25'"),
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
