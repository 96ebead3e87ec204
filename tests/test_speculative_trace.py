"""`trace_speculation`: speculative decoding one round at a time, keeping each drafted tree,
checked against `speculative_generate`, the target's plain decoding and the acceptance rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.config import ModelConfig
from castle_jax.inference import generate, speculative_generate
from castle_jax.inference.speculative import TreeShape, trace_speculation
from helpers import random_longspec_pair

# Its module-scoped fixtures are costly (trained models, compiled steps): one worker runs the
# whole module under `--dist loadgroup`, so they are built once.
pytestmark = pytest.mark.xdist_group("test_speculative_trace")

VOCAB = 8
TREE = (3, 6, 6)


@pytest.fixture(scope="module")
def pair():
  # A large init makes a random target's predictions depend on its context, so drafts are
  # sometimes accepted and sometimes not.
  return random_longspec_pair(
    ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, dtype="float32", init_std=0.3)
  )


def _prompt(length, seed):
  return jax.random.randint(jax.random.key(seed), (1, length), 0, VOCAB, dtype=jnp.int32)


@pytest.fixture(scope="module")
def greedy_trace(pair):
  target, target_params, draft, draft_params = pair
  prompt = _prompt(6, seed=1)
  return prompt, trace_speculation(target, target_params, draft, draft_params, prompt, max_new_tokens=24, tree=TREE)


def test_greedy_trace_emits_the_tokens_of_speculative_and_plain_decoding(pair, greedy_trace):
  target, target_params, draft, draft_params = pair
  prompt, trace = greedy_trace
  result = speculative_generate(target, target_params, draft, draft_params, prompt, max_new_tokens=24, tree=TREE)
  np.testing.assert_array_equal(trace.tokens, result.tokens)
  np.testing.assert_array_equal(trace.tokens, generate(target, target_params, prompt, max_new_tokens=24))
  np.testing.assert_array_equal(trace.tokens_per_round, result.tokens_per_round)
  assert trace.mean_accepted == pytest.approx(result.mean_accepted)
  # Some rounds accept drafts and some do not: both sides of the verdict are exercised.
  kept = {drafted.kept for drafted in trace.rounds}
  assert 1 in kept and max(kept) > 1


def test_a_padded_prompt_traces_as_its_tokens(pair, greedy_trace):
  target, target_params, draft, draft_params = pair
  prompt, trace = greedy_trace
  padded = jnp.concatenate([prompt, jnp.full((1, 3), VOCAB - 1, jnp.int32)], axis=1)
  traced = trace_speculation(
    target, target_params, draft, draft_params, padded, prompt_lengths=[6], max_new_tokens=24, tree=TREE
  )
  np.testing.assert_array_equal(traced.tokens, trace.tokens)
  np.testing.assert_array_equal(traced.tokens_per_round, trace.tokens_per_round)


def test_each_round_is_a_tree_of_the_requested_shape_rooted_at_the_last_token(greedy_trace):
  prompt, trace = greedy_trace
  shape = TreeShape(TREE)
  committed = np.asarray(trace.tokens[0])
  for drafted in trace.rounds:
    assert drafted.tokens.shape == drafted.parents.shape == drafted.target_next.shape == (shape.nodes,)
    assert drafted.tokens[0] == committed[drafted.position]  # the root: the last committed token
    for level in range(1, shape.depth + 1):
      start = shape.level_start(level)
      parents = drafted.parents[start : start + shape.level_size(level)]
      assert ((parents >= shape.level_start(level - 1)) & (parents < start)).all()
    # Each level's (parent, token) pairs are distinct: the draft's top-n continuations.
    assert len(set(zip(drafted.parents.tolist(), drafted.tokens.tolist()))) == shape.nodes
    # What the round emitted follows its root in the output (the last round may be cut).
    end = min(drafted.position + 1 + drafted.kept, committed.size)
    np.testing.assert_array_equal(committed[drafted.position + 1 : end], drafted.emitted[: end - drafted.position - 1])
  positions = [drafted.position for drafted in trace.rounds]
  assert positions[0] == prompt.shape[1] - 1
  np.testing.assert_array_equal(np.diff(positions), [drafted.kept for drafted in trace.rounds[:-1]])


def test_greedy_verdict_is_the_longest_path_of_target_argmaxes(greedy_trace):
  _, trace = greedy_trace
  for drafted in trace.rounds:
    path, target_next = drafted.path, drafted.target_next
    assert path[0] == 0
    np.testing.assert_array_equal(drafted.parents[path[1:]], path[:-1])
    # Every accepted node is the target's choice after its parent; the bonus is its choice
    # after the last accepted node, and no child of that node matches it (else it would
    # have been accepted too).
    np.testing.assert_array_equal(drafted.tokens[path[1:]], target_next[path[:-1]])
    np.testing.assert_array_equal(drafted.emitted, np.append(drafted.tokens[path[1:]], target_next[path[-1]]))
    children = np.nonzero(drafted.parents == path[-1])[0]
    assert not (drafted.tokens[children] == target_next[path[-1]]).any()


def test_target_next_is_the_argmax_of_decoding_each_branch(pair, greedy_trace):
  """The verification forward's argmax at each node equals the target's plain forward over
  the committed tokens followed by that node's branch."""
  target, target_params, _, _ = pair
  _, trace = greedy_trace
  drafted = trace.rounds[1]
  committed = trace.tokens[:, : drafted.position]
  forward = jax.jit(
    lambda tokens: target.apply({"params": target_params}, tokens, jnp.arange(tokens.shape[1])[None])[0][0, -1]
  )
  for node in range(drafted.tokens.size):
    branch = [node]
    while drafted.parents[branch[0]] >= 0:
      branch.insert(0, int(drafted.parents[branch[0]]))
    tokens = jnp.concatenate([committed, jnp.asarray(drafted.tokens[branch], jnp.int32)[None]], axis=1)
    assert int(jnp.argmax(forward(tokens))) == drafted.target_next[node], f"node {node}"


def test_sampling_trace_emits_the_tokens_of_speculative_decoding(pair):
  target, target_params, draft, draft_params = pair
  prompt = _prompt(5, seed=2)
  settings = dict(max_new_tokens=16, tree=(3, 6), temperature=1.0, top_k=5, rng=jax.random.key(3))
  trace = trace_speculation(target, target_params, draft, draft_params, prompt, **settings)
  result = speculative_generate(target, target_params, draft, draft_params, prompt, **settings)
  np.testing.assert_array_equal(trace.tokens, result.tokens)
  np.testing.assert_array_equal(trace.tokens_per_round, result.tokens_per_round)


def test_bad_request_is_named(pair):
  target, target_params, draft, draft_params = pair
  with pytest.raises(ValueError, match="trace_speculation traces one prompt, got a prompt batch of 2"):
    trace_speculation(target, target_params, draft, draft_params, jnp.zeros((2, 4), jnp.int32), max_new_tokens=4)
