"""LongSpec: the draft model, its training indices, tree verification by the target and
lossless speculative decoding (greedy and sampling)."""

import dataclasses
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from castle_jax.config import ModelConfig
from castle_jax.inference import generate, speculative_generate
from castle_jax.inference.speculative import TreeShape, _accept_sampling
from castle_jax.layers.mha import TreeVerification
from castle_jax.models import build_model, longspec_draft
from castle_jax.models.longspec_draft import LongSpecDraft
from castle_jax.ops.tree_attention import tree_mask_from_parents
from castle_jax.workdir import load_frozen_params
from helpers import random_longspec_pair

# Its tests share a module-scoped random pair and the programs compiled for it (the target's
# and the draft's decoding at the same shapes): one worker runs the whole module under
# `--dist loadgroup`, so they are built and traced once.
pytestmark = pytest.mark.xdist_group("test_longspec")

VOCAB = 8


def _target_config(**overrides):
  # A large init makes a random target's predictions depend on its context (a tiny std
  # gives a model that repeats one token, where every test would pass trivially).
  fields = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, dtype="float32", init_std=0.3)
  fields.update(overrides)
  return ModelConfig(**fields)


def _draft_config(target_config, **options):
  options = {"window": 8, **options}
  return dataclasses.replace(target_config, family="longspec_draft", family_kwargs=tuple(sorted(options.items())))


@pytest.fixture(scope="module")
def pair():
  return random_longspec_pair(_target_config())


def _prompt(length, seed):
  return jax.random.randint(jax.random.key(seed), (1, length), 0, VOCAB, dtype=jnp.int32)


@pytest.mark.parametrize("prompt_len,tree", [(1, (4, 8, 8)), (5, (1, 1, 1, 1)), (23, (2, 8, 8, 8))])
def test_greedy_speculative_decoding_equals_greedy_target_decoding(pair, prompt_len, tree):
  target, target_params, draft, draft_params = pair
  prompt = _prompt(prompt_len, seed=prompt_len)
  expected = generate(target, target_params, prompt, max_new_tokens=30)
  result = speculative_generate(target, target_params, draft, draft_params, prompt, max_new_tokens=30, tree=tree)
  np.testing.assert_array_equal(result.tokens, expected)
  assert result.tokens_per_round.sum() == 30
  assert result.tokens_per_round.max() <= len(tree) + 1
  # Drafts were accepted: the test exercises commits of several tokens, not only bonuses.
  assert result.mean_accepted > 1.0


def test_cache_after_acceptance_equals_the_cache_of_sequential_decoding(pair):
  target, target_params, draft, draft_params = pair
  prompt = _prompt(11, seed=3)
  result = speculative_generate(target, target_params, draft, draft_params, prompt, max_new_tokens=20, tree=(4, 8, 8))
  committed = result.tokens[:, :-1]  # every token but the last emitted one
  caches = target.init_cache(1, committed.shape[1])
  positions = jnp.arange(committed.shape[1])[None]
  _, sequential = target.apply({"params": target_params}, committed, positions, caches)
  length = committed.shape[1]
  assert int(result.caches[0].length[0]) >= length
  for ours, theirs in zip(result.caches, sequential):
    np.testing.assert_allclose(ours.keys[:, :length], theirs.keys, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(ours.values[:, :length], theirs.values, atol=2e-5, rtol=2e-5)
  # The draft's ring holds the self-attention entries of the last committed positions.
  ring = result.draft_cache.ring
  h = longspec_draft.embed_tokens(target.config, target_params, committed)
  keys, _ = draft.apply({"params": draft_params}, h, positions, method=LongSpecDraft.self_keys_values)
  ring_positions = np.asarray(ring.positions)[0]
  filled = ring_positions[(ring_positions >= 0) & (ring_positions < length)]
  assert filled.size >= draft.options.window
  slots = np.nonzero((ring_positions >= 0) & (ring_positions < length))[0]
  np.testing.assert_allclose(ring.keys[0, slots], keys[0, ring_positions[slots]], atol=1e-5, rtol=1e-5)


def test_tree_verification_equals_decoding_each_branch(pair):
  """The target's tree pass gives each node the logits of decoding its own branch."""
  target, target_params, _, _ = pair
  prefix = _prompt(9, seed=4)
  caches = target.init_cache(1, 32)
  _, caches = target.apply({"params": target_params}, prefix, jnp.arange(9)[None], caches)
  parents = jnp.array([-1, 0, 0, 1, 1, 2, 3], jnp.int32)
  tokens = _prompt(parents.size, seed=5)
  ancestors = tree_mask_from_parents(parents)
  depths = jnp.sum(ancestors, axis=-1) - 1
  decode = jax.jit(lambda tokens, positions: target.apply({"params": target_params}, tokens, positions, caches)[0])
  expected = []
  for node in range(parents.size):
    branch = np.nonzero(np.asarray(ancestors[node]))[0]
    expected.append(decode(tokens[:, branch], 9 + jnp.arange(branch.size)[None])[0, -1])
  for implementation in ("reference", "xla"):
    logits, pending = target.apply(
      {"params": target_params}, tokens, 9 + depths[None], caches, TreeVerification(ancestors[None], implementation)
    )
    assert int(pending[0].keys.shape[1]) == parents.size
    np.testing.assert_allclose(logits[0], jnp.stack(expected), atol=2e-5, rtol=2e-5)


def _probabilities(logits):
  logits = np.asarray(logits, np.float64)
  p = np.exp(logits - logits.max())
  return p / p.sum()


def test_sampling_acceptance_preserves_the_target_distribution():
  """Many draws of one round's acceptance: the first emitted token follows the root's target
  distribution, and the second, after an accepted first node, that node's distribution
  (chi-squared tests on an 8-token vocabulary)."""
  shape = TreeShape((3, 4))
  rng = np.random.default_rng(0)
  parents = jnp.array([-1, 0, 0, 0, 1, 1, 2, 3], jnp.int32)
  tokens = jnp.array([0, 2, 5, 7, 1, 3, 2, 6], jnp.int32)
  logits = jnp.asarray(rng.normal(size=(shape.nodes, VOCAB)) * 1.5, jnp.float32)
  draws = 20_000
  accept = jax.jit(jax.vmap(lambda key: _accept_sampling(shape, tokens, parents, logits, key, 1.0, 0, 1.0)))
  path, kept, bonus = accept(jax.random.split(jax.random.key(0), draws))
  path, kept, bonus = np.asarray(path), np.asarray(kept), np.asarray(bonus)
  first = np.where(kept >= 2, np.asarray(tokens)[path[:, 1]], bonus)
  root_p = _probabilities(logits[0])
  observed = np.bincount(first, minlength=VOCAB)
  assert stats.chisquare(observed, root_p * draws).pvalue > 1e-3
  assert (kept >= 2).mean() > 0.2  # acceptance happens, so the path logic is exercised
  node = 1  # root's child with token 2
  after = (kept >= 2) & (path[:, 1] == node)
  second = np.where(kept[after] >= 3, np.asarray(tokens)[path[after, 2]], bonus[after])
  node_p = _probabilities(logits[node])
  observed = np.bincount(second, minlength=VOCAB)
  assert stats.chisquare(observed, node_p * after.sum()).pvalue > 1e-3


def test_sampling_runs_end_to_end_and_is_reproducible(pair):
  target, target_params, draft, draft_params = pair
  prompt = _prompt(7, seed=6)
  run = lambda key: speculative_generate(
    target, target_params, draft, draft_params, prompt, max_new_tokens=16, tree=(4, 8), temperature=1.0, rng=key
  )
  a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  assert a.tokens.shape == (1, 23) and int(a.tokens.max()) < VOCAB and a.tokens_per_round.sum() == 16


def _rows_prompt(batch, length, seed):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, VOCAB, dtype=jnp.int32)


def test_batched_greedy_rows_equal_their_own_greedy_decoding(pair):
  """Three rows accept different numbers of drafts per round; each row's tokens are the
  target's greedy decoding of that row, and a row that finishes first stops growing."""
  target, target_params, draft, draft_params = pair
  prompt = _rows_prompt(3, 9, seed=21)
  result = speculative_generate(target, target_params, draft, draft_params, prompt, max_new_tokens=24, tree=(4, 8, 8))
  for row in range(3):
    expected = generate(target, target_params, prompt[row : row + 1], max_new_tokens=24)
    np.testing.assert_array_equal(result.tokens[row : row + 1], expected)
  counts = result.row_tokens_per_round
  assert counts.shape == (3, result.rounds)
  np.testing.assert_array_equal(counts.sum(axis=1), [24, 24, 24])
  # The rows grow apart: some round has rows that keep different numbers of tokens, and
  # a row that needed fewer rounds emits nothing after its last.
  assert any(len(set(counts[:, r][counts[:, r] > 0])) > 1 for r in range(result.rounds))
  assert len(set(result.row_rounds.tolist())) > 1
  for row in range(3):
    assert (counts[row, result.row_rounds[row] :] == 0).all() and (counts[row, : result.row_rounds[row]] > 0).all()
  np.testing.assert_allclose(result.row_mean_accepted, 24 / result.row_rounds)
  assert result.mean_accepted == pytest.approx(72 / result.row_rounds.sum())
  assert result.mean_accepted > 1.0
  # Each row's cache holds its own committed tokens at its own length.
  lengths = np.asarray(result.caches[0].length)
  single = [
    speculative_generate(
      target, target_params, draft, draft_params, prompt[row : row + 1], max_new_tokens=24, tree=(4, 8, 8)
    )
    for row in range(3)
  ]
  for row, alone in enumerate(single):
    np.testing.assert_array_equal(alone.row_tokens_per_round[0], counts[row, : result.row_rounds[row]])
    assert lengths[row] == int(alone.caches[0].length[0])
    np.testing.assert_allclose(
      result.caches[0].keys[row, : lengths[row]], alone.caches[0].keys[0, : lengths[row]], atol=2e-5, rtol=2e-5
    )


def test_batched_sampling_emits_valid_tokens_and_rows_follow_the_target(pair):
  """A batch of one prompt repeated: every row samples on its own (the rows differ), each
  is reproducible, and the rows' first new tokens follow the target's distribution."""
  target, target_params, draft, draft_params = pair
  rows = 64
  prompt = jnp.tile(_prompt(6, seed=8), (rows, 1))
  run = lambda key: speculative_generate(
    target, target_params, draft, draft_params, prompt, max_new_tokens=6, tree=(4, 8), temperature=1.0, rng=key
  )
  a, b = run(jax.random.key(3)), run(jax.random.key(3))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  tokens = np.asarray(a.tokens)
  assert tokens.shape == (rows, 12) and tokens.min() >= 0 and tokens.max() < VOCAB
  np.testing.assert_array_equal(tokens[:, :6], np.asarray(prompt))
  np.testing.assert_array_equal(a.row_tokens_per_round.sum(axis=1), np.full(rows, 6))
  assert len({tuple(row) for row in tokens[:, 6:]}) > rows // 2
  logits = target.apply({"params": target_params}, prompt[:1])[0][0, -1]
  observed = np.bincount(tokens[:, 6], minlength=VOCAB)
  expected = _probabilities(logits) * rows
  # Pool rare tokens so every expected count is large enough for the chi-squared test.
  rare = expected < 5
  observed = np.append(observed[~rare], observed[rare].sum())
  expected = np.append(expected[~rare], expected[rare].sum())
  assert stats.chisquare(observed, expected).pvalue > 1e-3


RAGGED_LENGTHS = (5, 9, 13)  # below, at and past the draft's window of 8


def _ragged_prompts(lengths, seed):
  return [np.asarray(_prompt(length, seed=seed + i))[0].tolist() for i, length in enumerate(lengths)]


@pytest.fixture(scope="module")
def ragged_rows_and_result(pair):
  """Greedy speculative decoding of a batch of the prompts of RAGGED_LENGTHS, given as a
  list of rows: (rows, result)."""
  target, target_params, draft, draft_params = pair
  rows = _ragged_prompts(RAGGED_LENGTHS, seed=30)
  return rows, speculative_generate(target, target_params, draft, draft_params, rows, max_new_tokens=20, tree=(4, 8, 8))


def test_prompts_of_different_lengths_decode_as_each_row_alone(pair, ragged_rows_and_result):
  """Greedy: each row of a batch of prompts of lengths 5, 9 and 13 emits the target's greedy
  decoding of that prompt alone, and drafts exactly as speculative decoding of it alone does
  (the same tokens per round: the pad columns reach neither the target nor the draft)."""
  target, target_params, draft, draft_params = pair
  rows, result = ragged_rows_and_result
  tokens = np.asarray(result.tokens)
  assert tokens.shape == (3, 13 + 20)
  np.testing.assert_array_equal(result.prompt_lengths, RAGGED_LENGTHS)
  for i, row in enumerate(rows):
    expected = np.asarray(generate(target, target_params, jnp.asarray([row]), max_new_tokens=20))[0]
    np.testing.assert_array_equal(tokens[i, : len(row) + 20], expected)
    assert (tokens[i, len(row) + 20 :] == 0).all()
    np.testing.assert_array_equal(result.new_tokens[i], expected[len(row) :])
    alone = speculative_generate(
      target, target_params, draft, draft_params, jnp.asarray([row]), max_new_tokens=20, tree=(4, 8, 8)
    )
    np.testing.assert_array_equal(result.row_tokens_per_round[i, : result.row_rounds[i]], alone.row_tokens_per_round[0])
    length = int(alone.caches[0].length[0])
    assert int(result.caches[0].length[i]) == length
    np.testing.assert_allclose(
      result.caches[-1].keys[i, :length], alone.caches[-1].keys[0, :length], atol=2e-5, rtol=2e-5
    )
  np.testing.assert_array_equal(result.row_tokens_per_round.sum(axis=1), [20, 20, 20])
  assert result.mean_accepted > 1.0


def test_a_padded_prompt_with_prompt_lengths_decodes_as_the_list_of_rows(pair, ragged_rows_and_result):
  """An int [batch, 13] prompt whose pad columns hold tokens, with prompt_lengths saying where
  rows end, decodes exactly as the same rows given as a list (which the test above checks
  row by row against each prompt alone): the pad columns reach neither model."""
  target, target_params, draft, draft_params = pair
  rows, unpadded = ragged_rows_and_result
  prompt = np.array(_rows_prompt(3, 13, seed=40))
  for i, row in enumerate(rows):
    prompt[i, : len(row)] = row
  result = speculative_generate(
    target, target_params, draft, draft_params, prompt, prompt_lengths=RAGGED_LENGTHS, max_new_tokens=20, tree=(4, 8, 8)
  )
  np.testing.assert_array_equal(result.prompt_lengths, RAGGED_LENGTHS)
  np.testing.assert_array_equal(result.tokens, unpadded.tokens)
  np.testing.assert_array_equal(result.new_tokens, unpadded.new_tokens)
  np.testing.assert_array_equal(result.row_rounds, unpadded.row_rounds)
  np.testing.assert_array_equal(result.row_tokens_per_round, unpadded.row_tokens_per_round)
  for i, row in enumerate(rows):
    length = int(unpadded.caches[0].length[i])
    assert int(result.caches[0].length[i]) == length
    np.testing.assert_allclose(
      result.caches[-1].keys[i, :length], unpadded.caches[-1].keys[i, :length], atol=2e-5, rtol=2e-5
    )


def test_prompts_of_different_lengths_sample_as_in_an_equal_length_batch(pair):
  """Sampling: a row's draws depend on the key, its prompt and its place in the batch only,
  so each row of a ragged batch equals that row of a batch repeating its prompt (an
  equal-length batch of the same size); the same key repeats a run, another changes it."""
  target, target_params, draft, draft_params = pair
  rows = _ragged_prompts((1, 6, 11), seed=50)
  run = lambda prompt, key: speculative_generate(
    target, target_params, draft, draft_params, prompt, max_new_tokens=12, tree=(4, 8), temperature=1.0, rng=key
  )
  a, b, c = run(rows, jax.random.key(5)), run(rows, jax.random.key(5)), run(rows, jax.random.key(6))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)
  tokens = np.asarray(a.tokens)
  assert tokens.shape == (3, 23) and tokens.min() >= 0 and tokens.max() < VOCAB
  np.testing.assert_array_equal(a.row_tokens_per_round.sum(axis=1), [12, 12, 12])
  for i, row in enumerate(rows):
    repeated = run(jnp.asarray([row] * 3), jax.random.key(5))
    np.testing.assert_array_equal(tokens[i, : len(row)], row)
    np.testing.assert_array_equal(a.new_tokens[i], np.asarray(repeated.tokens)[i, len(row) :])
    np.testing.assert_array_equal(
      a.row_tokens_per_round[i, : a.row_rounds[i]], repeated.row_tokens_per_round[i, : repeated.row_rounds[i]]
    )


def test_bad_prompts_are_named(pair):
  target, target_params, draft, draft_params = pair
  call = lambda prompt, **kw: speculative_generate(
    target, target_params, draft, draft_params, prompt, max_new_tokens=4, **kw
  )
  with pytest.raises(
    ValueError, match=r"len\(prompt\[1\]\) = 0: every prompt row needs >= 1 token.*drop the empty row"
  ):
    call([[1, 2], [], [3]])
  with pytest.raises(ValueError, match="prompt is an empty list"):
    call([])
  with pytest.raises(ValueError, match=r"prompt row 1 must be a sequence of int token ids, got float64"):
    call([[1, 2], [0.5, 1.0]])
  with pytest.raises(
    ValueError, match=r"prompt row 0 must be a sequence of int token ids, got int64 of shape \(1, 2\)"
  ):
    call([[[1, 2]]])
  with pytest.raises(
    ValueError, match=r"prompt row 1 holds token 8 at column 2, outside the target's vocabulary \[0, 8\)"
  ):
    call([[1, 2], [3, 4, 8]])
  padded = jnp.zeros((2, 5), jnp.int32)
  with pytest.raises(ValueError, match=r"prompt_lengths\[1\] = 6 exceeds the prompt's 5 columns.*pad the prompt"):
    call(padded, prompt_lengths=[3, 6])
  with pytest.raises(ValueError, match=r"prompt_lengths\[0\] = 0: every prompt row needs >= 1 token"):
    call(padded, prompt_lengths=[0, 5])
  with pytest.raises(
    ValueError, match=r"prompt_lengths must be int \[batch\] with batch = \(2,\).*got int64 of shape \(3,\)"
  ):
    call(padded, prompt_lengths=[1, 2, 3])
  with pytest.raises(
    ValueError, match="prompt_lengths goes with an int \\[batch, prompt_len\\] prompt.*drop prompt_lengths"
  ):
    call([[1, 2], [3]], prompt_lengths=[2, 1])
  # Pad columns may hold anything, even ids outside the vocabulary.
  result = call(jnp.asarray([[1, 2, 99], [3, 4, 5]]), prompt_lengths=[2, 3])
  np.testing.assert_array_equal(np.asarray(result.tokens)[:, :2], [[1, 2], [3, 4]])


def test_caches_reject_a_batch_they_were_not_built_for(pair):
  from castle_jax.ops.attention import KVCache, WindowKVCache

  keys = jnp.zeros((3, 2, 2, 8))
  for cache in (KVCache.create(2, 16, 2, 8, jnp.float32), WindowKVCache.create(2, 16, 2, 8, jnp.float32)):
    with pytest.raises(ValueError, match="cannot append a batch of 3 rows to a .*built for batch 2; create the cache"):
      cache.append(keys, keys)
  with pytest.raises(ValueError, match="rows need \\[18, 4\\] slots > capacity 16"):
    KVCache.create(2, 16, 2, 8, jnp.float32).per_row().replace(length=jnp.array([15, 1])).append(
      keys[:2], keys[:2], count=jnp.array([3, 3])
    )


def test_per_row_cache_appends_equal_one_row_appends():
  """Per-row appends write each row's first `count` entries at its own length and leave
  everything else as it was (the reference: one row at a time with one length)."""
  from castle_jax.ops.attention import KVCache, WindowKVCache

  rng = np.random.default_rng(0)
  new = jnp.asarray(rng.normal(size=(3, 4, 2, 8)), jnp.float32)
  counts, lengths = np.array([4, 0, 2]), np.array([5, 13, 9])
  cache = KVCache.create(3, 16, 2, 8, jnp.float32)
  cache = cache.replace(keys=jnp.asarray(rng.normal(size=cache.keys.shape), jnp.float32), values=cache.keys)
  appended = cache.per_row().replace(length=jnp.asarray(lengths, jnp.int32)).append(new, new, count=jnp.asarray(counts))
  np.testing.assert_array_equal(appended.length, lengths + counts)
  for row in range(3):
    one = KVCache(cache.keys[row : row + 1], cache.values[row : row + 1], jnp.int32(lengths[row]))
    one = one.append(new[row : row + 1, : counts[row]], new[row : row + 1, : counts[row]]) if counts[row] else one
    np.testing.assert_array_equal(appended.keys[row], one.keys[0])
    np.testing.assert_array_equal(appended.key_positions()[row], one.key_positions()[0])
  ring = WindowKVCache.create(3, 6, 2, 8, jnp.float32)
  ring = ring.append(jnp.ones((3, 5, 2, 8)), jnp.ones((3, 5, 2, 8))).per_row()
  ring = ring.replace(length=jnp.asarray([5, 5, 5], jnp.int32))
  grown = ring.append(new, new, count=jnp.asarray(counts))
  np.testing.assert_array_equal(grown.length, [9, 5, 7])
  for row in range(3):
    one = WindowKVCache(ring.keys[row : row + 1], ring.values[row : row + 1], ring.positions[row], jnp.int32(5))
    one = one.append(new[row : row + 1, : counts[row]], new[row : row + 1, : counts[row]]) if counts[row] else one
    np.testing.assert_array_equal(grown.keys[row], one.keys[0])
    np.testing.assert_array_equal(grown.positions[row], one.positions)


@pytest.mark.parametrize("values", ["distinct", "tied", "tied_with_minus_infinity"])
def test_best_children_are_the_top_k_of_the_flattened_scores(values):
  """The two-step selection of a level's children picks what one top_k over the flattened
  [nodes x V] scores picks, in the same order, ties (equal cumulative log-probabilities,
  -inf for masked tokens) to the lower node, then the lower token."""
  from castle_jax.inference.speculative import _best_children

  rng = np.random.default_rng(0)
  for batch, size, vocab, width in [(1, 1, 9, 4), (2, 4, 7, 16), (1, 16, 50, 16), (3, 3, 2, 5), (1, 2, 1, 2)]:
    scores = rng.normal(size=(batch, size, vocab))
    if values != "distinct":
      scores = rng.integers(0, 3, size=scores.shape).astype(float)
    if values == "tied_with_minus_infinity":
      scores[rng.random(scores.shape) < 0.5] = -np.inf
    scores = jnp.asarray(scores, jnp.float32)
    best, flat = jax.lax.top_k(scores.reshape(batch, -1), width)
    got = _best_children(scores, width)
    for name, value, expected in zip(("scores", "nodes", "tokens"), got, (best, flat // vocab, flat % vocab)):
      np.testing.assert_array_equal(value, expected, err_msg=f"{name} of {batch}x{size}x{vocab}, top {width}")
      assert value.dtype == expected.dtype, name


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_top_k_of_a_round_is_longer_than_the_vocabulary(temperature):
  """A round of a 128K-vocabulary model (lowered for abstract inputs, never run) selects
  with top_k rows of at most V elements: a row over a tree level's flattened nodes x V
  scores (here 16 x 128256, over 2^20) goes through XLA's GPU splitting of long top-k rows,
  which can blow the compile up; CPU runs of small vocabularies never show it."""
  import re

  from castle_jax.inference import speculative
  from castle_jax.inference.generate import prefill_caches

  vocab, batch, capacity = 128256, 1, 64
  config = _target_config(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1)
  target, draft = build_model(config), build_model(_draft_config(config))
  target_params = jax.eval_shape(
    lambda: nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  )
  draft_params = jax.eval_shape(lambda: nn.unbox(longspec_draft.init_variables(draft, jax.random.key(1), 8)["params"]))
  shape = TreeShape((4, 16, 16))
  rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
  empty = jnp.zeros((batch, 0), jnp.int32)
  caches = jax.eval_shape(
    lambda: [c.replace(length=jnp.zeros((batch,), jnp.int32)) for c in prefill_caches(target, None, empty, capacity)]
  )
  draft_cache = jax.eval_shape(
    lambda: speculative._prefill_draft(draft, None, config, None, empty, np.zeros(batch, np.int32), shape)
  )
  lowered = speculative._traced_round.lower(
    target,
    draft,
    shape,
    temperature,
    50,
    1.0,
    None,
    target_params,
    draft_params,
    caches,
    draft_cache,
    rows,
    rows,
    jax.ShapeDtypeStruct((batch,), jnp.bool_),
    jax.eval_shape(lambda: jax.random.key(0)),
  )
  rows_of_top_k = [
    int(dims.split("x")[-1]) for dims in re.findall(r"chlo\.top_k\(.*?: tensor<([0-9x]+)x", lowered.as_text())
  ]
  assert rows_of_top_k, "the round has no top_k left to check: update this test"
  assert max(rows_of_top_k) <= vocab, f"top_k rows of {sorted(set(rows_of_top_k))} elements, vocabulary {vocab}"


def test_draft_decoding_equals_its_training_forward(pair):
  """The draft's drafting forward (ring + tree slots, cross-attention over the target's
  cache) at the root equals its training forward with shift 1 at the same position,
  past the window."""
  target, target_params, draft, draft_params = pair
  tokens = _prompt(21, seed=7)
  positions = jnp.arange(21)[None]
  cfg = target.config
  keys, values = longspec_draft.target_last_layer_keys_values(cfg, target_params, tokens, positions)
  h = longspec_draft.embed_tokens(cfg, target_params, tokens)
  trained = draft.apply({"params": draft_params}, h, positions, keys, values, jnp.int32(1))
  # Decoding the root at position 20: the target's cache holds 0..19, the ring 0..19.
  caches = target.init_cache(1, 24)
  _, caches = target.apply({"params": target_params}, tokens[:, :20], positions[:, :20], caches)
  cache = longspec_draft.DraftSelfCache.create(draft.config, 1, draft.options.window, 3, 2)
  ring_keys, ring_values = draft.apply(
    {"params": draft_params}, h[:, :20], positions[:, :20], method=LongSpecDraft.self_keys_values
  )
  cache = cache.replace(
    ring=cache.ring.replace(length=jnp.int32(20 - cache.ring.capacity)).append(
      ring_keys[:, 20 - cache.ring.capacity :], ring_values[:, 20 - cache.ring.capacity :]
    )
  )
  visible = jnp.zeros((1, 1, 3), bool).at[0, 0, 0].set(True)
  out, _ = draft.apply(
    {"params": draft_params},
    h[:, 20:],
    positions[:, 20:],
    cache,
    jnp.array([0]),
    visible,
    caches[-1].keys,
    caches[-1].values,
    caches[-1].length,
    method=LongSpecDraft.draft,
  )
  np.testing.assert_allclose(out[0, 0], trained[0, 20], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("shift", [1, 3])
def test_draft_never_reads_the_target_past_its_shift(pair, shift):
  """With shift j the output at i depends on the target's keys/values at <= i - j only."""
  target, target_params, draft, draft_params = pair
  cfg = target.config
  tokens, positions = _prompt(12, seed=8), jnp.arange(12)[None]
  keys, values = longspec_draft.target_last_layer_keys_values(cfg, target_params, tokens, positions)
  h = longspec_draft.embed_tokens(cfg, target_params, tokens)
  base = draft.apply({"params": draft_params}, h, positions, keys, values, jnp.int32(shift))
  changed_at = 6
  poked = draft.apply(
    {"params": draft_params},
    h,
    positions,
    keys.at[:, changed_at].add(3.0),
    values.at[:, changed_at].add(3.0),
    jnp.int32(shift),
  )
  differs = np.abs(np.asarray(poked - base)).max(axis=(0, 2)) > 1e-6
  np.testing.assert_array_equal(differs, np.arange(12) >= changed_at + shift)


def test_anchor_offset_positions():
  positions = np.asarray(longspec_draft.anchor_offset_positions(jax.random.key(0), (64, 10), 4, 100))
  np.testing.assert_array_equal(positions[:, :4], np.broadcast_to(np.arange(4), (64, 4)))
  np.testing.assert_array_equal(np.diff(positions[:, 4:], axis=1), 1)
  offsets = positions[:, 4] - 4
  assert offsets.min() >= 0 and offsets.max() <= 100 and len(set(offsets.tolist())) > 20
  plain = longspec_draft.anchor_offset_positions(jax.random.key(0), (2, 10), 4, 0)
  np.testing.assert_array_equal(plain, np.broadcast_to(np.arange(10), (2, 10)))


def test_training_loss_draws_offsets_and_shifts_only_in_training(pair):
  target, target_params, _, _ = pair
  draft = build_model(_draft_config(target.config, max_offset=50, min_shift=1, max_shift=4))
  params = {**nn.unbox(longspec_draft.init_variables(draft, jax.random.key(1), 8)["params"]), "target": target_params}
  batch = {"inputs": _prompt(16, seed=9), "targets": _prompt(16, seed=10)}
  evaluation = jax.jit(lambda: longspec_draft.token_losses(draft, params, batch, -1, None)[0].sum())
  np.testing.assert_array_equal(evaluation(), evaluation())
  loss = jax.jit(lambda p, rng: longspec_draft.token_losses(draft, p, batch, -1, rng)[0].sum())
  training = {float(loss(params, jax.random.key(i))) for i in range(6)}
  assert len(training) > 1 and all(np.isfinite(list(training)))
  grads = jax.jit(jax.grad(loss))(params, jax.random.key(0))
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads["target"]))
  assert float(jnp.abs(grads["cross_attention"]["query"]["kernel"]).max()) > 0


def test_draft_memory_is_constant_in_the_context_length(pair):
  _, _, draft, _ = pair
  sizes = {
    length: sum(
      x.nbytes
      for x in jax.tree.leaves(longspec_draft.DraftSelfCache.create(draft.config, 1, draft.options.window, 69, 6))
    )
    for length in (1, 10**6)
  }
  assert len(set(sizes.values())) == 1
  assert longspec_draft.param_count(draft.config) == sum(
    x.size for x in jax.tree.leaves(longspec_draft.init_variables(draft, jax.random.key(0), 4)["params"])
  )


def test_bad_input_is_named(pair):
  target, target_params, draft, draft_params = pair
  prompt = _prompt(4, seed=11)
  call = lambda **kw: speculative_generate(
    target, target_params, draft, draft_params, kw.pop("prompt", prompt), **{"max_new_tokens": 4, **kw}
  )
  with pytest.raises(ValueError, match=r"prompt batch must be >= 1, got prompt of shape \(0, 4\)"):
    call(prompt=jnp.zeros((0, 4), jnp.int32))
  with pytest.raises(ValueError, match="tree level 1 keeps 9 nodes"):
    call(tree=(9,))
  with pytest.raises(ValueError, match="window"):
    call(tree=(1,) * 8)
  with pytest.raises(ValueError, match="tree must be"):
    call(tree=())
  with pytest.raises(ValueError, match="rng is required"):
    call(temperature=1.0)
  other = build_model(_draft_config(_target_config(d_model=48)))
  with pytest.raises(ValueError, match="model.d_model: target 32, draft 48"):
    speculative_generate(target, target_params, other, draft_params, prompt, max_new_tokens=2)
  with pytest.raises(ValueError, match="needs an `mha` target"):
    build_model(_draft_config(_target_config(sliding_window=4)))
  with pytest.raises(ValueError, match="max_shift"):
    build_model(_draft_config(_target_config(), min_shift=3, max_shift=2))
  with pytest.raises(ValueError, match="Unknown model.family_kwargs"):
    build_model(_draft_config(_target_config(), windw=4))
  with pytest.raises(ValueError, match="not a language model on its own"):
    longspec_draft.last_logits(draft, draft_params, prompt, 1)
  with pytest.raises(ValueError, match="target_workdir is empty"):
    load_frozen_params(draft.config)


def _draft_run(config_module, workdir, data_dir, target_workdir, **overrides):
  from helpers import tiny_run

  config = tiny_run(config_module, str(workdir), data_dir, **{"model.n_kv_heads": 1, **overrides})
  with config.unlocked():
    config.model.family_kwargs.target_workdir = target_workdir
    config.model.family_kwargs.window = 16
  return config


def test_a_draft_trains_against_its_frozen_target_and_decodes_through_the_workdirs(tmp_path, stdlib_data_dir, capfd):
  from configs import longspec_draft_tiny, longspec_draft_tiny_long, longspec_target_tiny
  from helpers import tiny_run
  from castle_jax.workdir import TrainedModel, frozen_record, load_draft, load_trained_model, params_fingerprint
  from train.trainer import train

  target_config = tiny_run(
    longspec_target_tiny, str(tmp_path / "target"), stdlib_data_dir, **{"model.n_kv_heads": 1, "data.seq_len": 64}
  )
  train(target_config)
  draft_config = _draft_run(longspec_draft_tiny, tmp_path / "draft", stdlib_data_dir, target_config.workdir)
  with draft_config.unlocked():
    draft_config.model.family_kwargs.max_offset = 32
  result = train(draft_config)
  assert "Frozen parameters ['target'] from step 8" in capfd.readouterr().err
  # Only the draft block trains: no target parameters in the state or the optimizer's.
  draft_size = sum(x.size for x in jax.tree.leaves(result.state.params))
  assert set(result.state.params) == {"self_norm", "self_attention", "cross_norm", "cross_attention", "mlp_norm", "mlp"}
  assert sum(x.size for x in jax.tree.leaves(result.state.opt_state)) <= 2 * draft_size + 8
  target = load_trained_model(target_config.workdir)
  assert frozen_record(draft_config.workdir)["fingerprint"] == params_fingerprint({"target": target.params})

  # Stage 2 starts from stage 1 although its anchor-offset setting differs.
  long_config = _draft_run(
    longspec_draft_tiny_long,
    tmp_path / "long",
    stdlib_data_dir,
    target_config.workdir,
    **{"data.seq_len": 64, "train.steps": 2},
  )
  with long_config.unlocked():
    long_config.train.init_from = draft_config.workdir
  train(long_config)

  draft = load_draft(long_config.workdir, target)
  text = "def main(x):\n    return"
  prompt = jnp.asarray([target.tokenizer.bos_id, *target.tokenizer.encode(text)], jnp.int32)[None]
  expected = generate(target.model, target.params, prompt, max_new_tokens=24)
  spoken = speculative_generate(
    target.model, target.params, draft.model, draft.params, prompt, max_new_tokens=24, tree=(2, 4, 4)
  )
  np.testing.assert_array_equal(spoken.tokens, expected)

  # The decoding above (the command puts the BOS first), whose compiled programs the command
  # finds in the compilation cache.
  command = [
    sys.executable,
    "-m",
    "train.generate",
    f"--workdir={target_config.workdir}",
    f"--draft_workdir={long_config.workdir}",
    "--temperature=0",
    "--max_new_tokens=24",
    "--tree=2,4,4",
    f"--prompt={text}",
  ]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  ran = subprocess.run(
    command, cwd=root, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": root}
  )
  assert ran.returncode == 0, ran.stderr[-2000:]
  assert "# speculative: draft step 2, tree [2, 4, 4]: tau" in ran.stdout
  with pytest.raises(ValueError, match="holds a 'transformer' model, not a 'longspec_draft' draft"):
    load_draft(target_config.workdir, target)
  other_target = TrainedModel(target.model, jax.tree.map(lambda x: x + 1.0, target.params), target.tokenizer, 8)
  with pytest.raises(ValueError, match="was trained for the target in"):
    load_draft(long_config.workdir, other_target)
  wide = _draft_run(
    longspec_draft_tiny, tmp_path / "wide", stdlib_data_dir, target_config.workdir, **{"model.d_model": 48}
  )
  with pytest.raises(ValueError, match="model.d_model: target 32, draft 48"):
    train(wide)
  assert not os.path.exists(os.path.join(wide.workdir, "checkpoints", "8"))
