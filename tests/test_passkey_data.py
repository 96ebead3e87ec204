"""The passkey training/eval stream (data.task="passkey")."""

import copy

import numpy as np
import pytest

from castle_jax.data.passkey_data import minimum_length
from castle_jax.data.pipeline import make_lm_iterator
from castle_jax.data.tokenizer import ByteTokenizer
from castle_jax.data.passkey_prompts import QUESTION
from train.config import base_config

TOKENIZER = ByteTokenizer()
PAD = TOKENIZER.pad_id


@pytest.fixture()
def data_config(tmp_path_factory, small_source_dir):
  c = copy.deepcopy(base_config().data)
  c.data_dir = str(tmp_path_factory.getbasetemp() / "small_tfds")
  c.source_dir = small_source_dir
  c.task = "passkey"
  c.seq_len, c.batch_size = 120, 4
  return c


def _iterator(data_config, split="train", process_index=0, process_count=1):
  return make_lm_iterator(
    data_config,
    TOKENIZER,
    split=split,
    shuffle=split == "train",
    process_index=process_index,
    process_count=process_count,
  )


def _batches(data_config, count=3, **kwargs):
  it = _iterator(data_config, **kwargs)
  return [next(it) for _ in range(count)]


def _needle_passkey(inputs_row) -> str:
  text = TOKENIZER.decode(inputs_row)
  return text.split("The passkey is: ")[1].split(".")[0]


def test_answer_targets_are_the_passkey_tokens_only(data_config):
  for batch in _batches(data_config):
    assert batch["inputs"].shape == batch["targets"].shape == (4, 120)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
      kept = np.flatnonzero(targets != PAD)
      passkey = _needle_passkey(inputs)
      assert len(passkey) == 5 and passkey.isdigit()
      # Exactly the passkey's tokens, contiguous, predicted from "... The passkey is ".
      np.testing.assert_array_equal(targets[kept], TOKENIZER.encode(passkey))
      np.testing.assert_array_equal(kept, np.arange(kept[0], kept[0] + len(kept)))
      assert TOKENIZER.decode(inputs[: kept[0] + 1]).endswith(QUESTION + " is ")
      np.testing.assert_array_equal(inputs[kept[:-1] + 1], targets[kept[:-1]])  # the answer is in the inputs too


def test_all_loss_is_the_shifted_prompt(data_config):
  data_config.passkey.loss = "all"
  data_config.passkey.align_to = 16
  for batch in _batches(data_config):
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert (batch["inputs"][:, 0] == TOKENIZER.bos_id).all()


@pytest.mark.parametrize("align_to", [16, 31])
def test_alignment_starts_a_chunk_at_the_answer(data_config, align_to):
  data_config.passkey.align_to = align_to
  for batch in _batches(data_config):
    for targets in batch["targets"]:
      answer_start = np.flatnonzero(targets != PAD)[0] + 1  # index in the token window
      assert (answer_start - len(" is ")) % align_to == 0


def test_lengths_vary_from_min_length_and_pad_the_tail(data_config):
  data_config.passkey.min_length = 80
  data_config.passkey.loss = "all"
  lengths = set()
  for batch in _batches(data_config, count=6):
    assert batch["inputs"].shape == (4, 120)
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
      last = np.flatnonzero(targets != PAD)[-1]  # the passkey's last digit ends the prompt
      assert (targets[last + 1 :] == PAD).all() and (inputs[last + 2 :] == PAD).all()
      lengths.add(last + 1)
  assert min(lengths) >= 80 and max(lengths) <= 120 and len(lengths) > 5


def _stack(batches):
  return np.stack([np.concatenate([b["inputs"], b["targets"]]) for b in batches])


def test_deterministic_by_seed_and_split(data_config):
  first = _stack(_batches(data_config))
  np.testing.assert_array_equal(first, _stack(_batches(data_config)))
  assert not np.array_equal(first, _stack(_batches(data_config, split="validation")))
  data_config.shuffle_seed = 1
  assert not np.array_equal(first, _stack(_batches(data_config)))
  rows = _stack(_batches(data_config, count=4)).reshape(-1, 120)
  assert len({row.tobytes() for row in rows}) == len(rows)  # every example differs


def test_processes_read_alternate_examples(data_config):
  whole = _batches(data_config, count=2)
  data_config.batch_size = 8
  shards = [_batches(data_config, count=1, process_index=i, process_count=2)[0] for i in range(2)]
  examples = np.concatenate([b["inputs"] for b in whole])  # examples 0..7 in order
  for i, shard in enumerate(shards):
    np.testing.assert_array_equal(shard["inputs"], examples[i::2])


def test_iterator_state_round_trip(data_config):
  it = _iterator(data_config)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]
  fresh = _iterator(data_config)
  fresh.set_state(state)
  for batch in expected:
    got = next(fresh)
    np.testing.assert_array_equal(got["inputs"], batch["inputs"])
    np.testing.assert_array_equal(got["targets"], batch["targets"])


def test_prefetch_keeps_the_batches(data_config):
  expected = _batches(data_config, count=4)
  it = make_lm_iterator(
    data_config, TOKENIZER, split="train", shuffle=True, process_index=0, process_count=1, prefetch=2
  )
  for batch in expected:
    np.testing.assert_array_equal(next(it)["inputs"], batch["inputs"])
  it.close()


def test_shortest_prompt_fits(data_config):
  need = minimum_length(TOKENIZER, 5, 16)
  data_config.seq_len = need - 1
  data_config.passkey.align_to = 16
  for batch in _batches(data_config, count=8):
    assert (batch["targets"] != PAD).sum() == 4 * 5
  data_config.seq_len = need - 2
  with pytest.raises(ValueError, match=r"data.seq_len .* too short.*raise data.seq_len"):
    _iterator(data_config)


@pytest.mark.parametrize(
  "key, value, match",
  [
    ("task", "mlm", r"data.task must be one of \('lm', 'passkey', 'variable_tracking', 'mqar'\)"),
    ("passkey.loss", "prompt", r"data.passkey.loss must be one of \('answer', 'all'\)"),
    ("passkey.digits", 0, "data.passkey.digits must be an int >= 1"),
    ("passkey.align_to", -1, "data.passkey.align_to must be 0"),
    ("passkey.min_length", 10, r"data.passkey.min_length \(10\) must be 0"),
    ("passkey.min_length", 121, r"data.passkey.min_length \(121\) must be 0"),
    ("seq_len", 30, r"data.seq_len \(30\) is too short"),
  ],
)
def test_bad_config_values_name_the_key(data_config, key, value, match):
  section = data_config.passkey if key.startswith("passkey.") else data_config
  section[key.split(".")[-1]] = value
  with pytest.raises(ValueError, match=match):
    _iterator(data_config)
