"""The shipped pretrained models: their parameters fit their models, and they do their task."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from castle_jax.data.tokenizer import load_tokenizer
from castle_jax.eval import cli, passkey, tasks
from castle_jax.models.pretrained import available_pretrained, load_pretrained

NAME = "drt_tiny_retrieval_topk"


@pytest.fixture(scope="module")
def pretrained():
  return load_pretrained(NAME)


def test_params_have_the_structure_and_shapes_of_the_models_init(pretrained):
  model, params, config = pretrained
  assert config.model.family == "drt" and model.options.top_k == 4
  chunk = jnp.zeros((1, model.options.chunk_size), jnp.int32)
  initialized = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), chunk))["params"])
  assert jax.tree.structure(params) == jax.tree.structure(initialized)
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  assert shapes(params) == shapes(initialized)
  assert sum(x.size for x in jax.tree.leaves(params)) == 1_091_712


def test_finds_the_passkey_in_1024_token_prompts(pretrained, stdlib_data_dir):
  # A model with random weights gets none of these right: its retrieval weights are near
  # uniform and it predicts the token it was fed.
  model, params, config = pretrained
  tokenizer = load_tokenizer(config.data.tokenizer)
  haystack = cli.validation_tokens(config, tokenizer, 4096, stdlib_data_dir)
  examples = passkey.make_examples(tokenizer, haystack, 1024, 3, seed=0, align_to=passkey.chunk_alignment(model))
  assert min(e.answer_start - e.needle_position for e in examples) > model.config.sliding_window
  scored = passkey.score_batch(model, params, examples)  # [(first digit right, all digits right)]
  assert scored == [(True, True)] * len(examples), [e.passkey for e in examples]


def test_unknown_name_lists_the_available_ones():
  assert NAME in available_pretrained()
  with pytest.raises(ValueError, match=f"No pretrained model 'drt_tiny'; available: .*{NAME}"):
    load_pretrained("drt_tiny")


# Query accuracy each shipped variable-tracking model reached on 400 fresh prompts when it was
# exported (docs/reproduction.md), less a margin for 64 prompts; chance is 0.10. A parameter
# stored under the wrong name or transposed would leave a model near chance.
VARIABLE_TRACKING_FLOORS = {
  "variable_tracking_mha_4_heads": 0.45,  # measured 0.566
  "variable_tracking_castle_2_heads": 0.75,  # 0.864
  "variable_tracking_castle_swl_2_heads": 0.40,  # 0.489
}


@pytest.mark.parametrize("name", sorted(VARIABLE_TRACKING_FLOORS))
def test_variable_tracking_models_answer_fresh_prompts(name):
  model, params, config = load_pretrained(name)
  assert config.data.task == "variable_tracking" and config.model.attention in name
  result = tasks.evaluate_task(
    model,
    params,
    load_tokenizer(config.data.tokenizer),
    "variable_tracking",
    dict(config.data.variable_tracking),
    examples=64,
  )
  assert result["overall"]["query_accuracy"] >= VARIABLE_TRACKING_FLOORS[name], result["overall"]
