"""Passkey prompts: layout, determinism, alignment, scoring."""

import numpy as np
import pytest

from castle_jax.data.tokenizer import ByteTokenizer
from castle_jax.eval import passkey

TOKENIZER = ByteTokenizer()
HAYSTACK = TOKENIZER.encode("def f(x):\n    return x + 1\n" * 20)


@pytest.mark.parametrize("length, align_to", [(200, None), (333, 64), (4096, 63)])
def test_example_layout(length, align_to):
  example = passkey.make_example(TOKENIZER, HAYSTACK, length, seed=3, align_to=align_to)
  assert example.tokens.shape == (length,) and example.tokens.dtype == np.int32
  text = TOKENIZER.decode(example.tokens)
  assert f"The passkey is: {example.passkey}." in text
  assert text.endswith(f"What is the passkey? The passkey is {example.passkey}")
  answer = example.tokens[example.answer_start : example.answer_start + example.answer_length]
  assert TOKENIZER.decode(answer) == example.passkey
  assert TOKENIZER.decode(example.tokens[example.needle_position :]).startswith(" The passkey is:")
  if align_to:
    assert (example.answer_start - len(" is ")) % align_to == 0


def test_examples_are_deterministic_by_seed():
  a, b, c = (passkey.make_example(TOKENIZER, HAYSTACK, 300, seed=s) for s in (1, 1, 2))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert a.passkey != c.passkey or a.needle_position != c.needle_position


def test_scoring_first_token_and_all_tokens():
  example = passkey.make_example(TOKENIZER, HAYSTACK, 120, seed=0, depth=0.5)
  logits = np.zeros((120, TOKENIZER.vocab_size))
  logits[np.arange(119), example.tokens[1:]] = 1.0  # a perfect teacher-forced predictor
  assert passkey.score(logits, example) == (True, True)
  last = example.answer_start + example.answer_length - 2
  logits[last] = 0
  logits[last, TOKENIZER.pad_id] = 1.0
  assert passkey.score(logits, example) == (True, False)
  result = passkey.accuracy(lambda tokens: logits[None], [example])
  assert result == {"first_token": 1.0, "all_tokens": 0.0, "examples": 1}


def test_too_short_is_an_error():
  with pytest.raises(ValueError, match="too short"):
    passkey.make_example(TOKENIZER, HAYSTACK, 40, seed=0)


@pytest.mark.parametrize("align_to", [None, 16])
def test_scoring_from_tail_logits_matches_full_logits(align_to):
  example = passkey.make_example(TOKENIZER, HAYSTACK, 150, seed=4, depth=0.3, align_to=align_to)
  logits = np.zeros((150, TOKENIZER.vocab_size))
  logits[np.arange(149), example.tokens[1:]] = 1.0  # a perfect teacher-forced predictor
  count = passkey.tail_count(example)
  assert count == 150 - example.answer_start + 1
  assert passkey.score_tail(logits[-count:], example) == passkey.score(logits, example) == (True, True)
  early = np.roll(logits, 1, axis=0)  # each row predicts the token before the right one
  assert passkey.score_tail(early[-count:], example) == (False, False)
  with pytest.raises(ValueError, match="tail_count"):
    passkey.score_tail(logits[-count - 1 :], example)


def test_examples_spread_depths_evenly_and_keep_passkeys_across_lengths():
  short, long = (passkey.make_examples(TOKENIZER, HAYSTACK, n, 4, seed=1) for n in (200, 400))
  assert [e.passkey for e in short] == [e.passkey for e in long]
  positions = [e.needle_position for e in long]
  assert positions == sorted(positions) and positions[0] < 400 * 0.25 < positions[1]
