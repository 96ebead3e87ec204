"""The python_stdlib TFDS corpus and the grain LM pipeline."""

import copy
import os

import numpy as np
import pytest

from castle_jax.data import python_stdlib
from castle_jax.data.pipeline import get_builder, get_data_source, make_lm_iterator
from castle_jax.data.tokenizer import ByteTokenizer
from train.config import base_config

TOKENIZER = ByteTokenizer()


@pytest.fixture()
def data_config(tmp_path_factory, small_source_dir):
  c = copy.deepcopy(base_config().data)
  c.data_dir = str(tmp_path_factory.getbasetemp() / "small_tfds")
  c.source_dir = small_source_dir
  c.seq_len, c.batch_size = 16, 4
  return c


def _documents(data_config, split):
  source = get_data_source("python_stdlib", split, data_config.data_dir, data_config.source_dir)
  return [source[i] for i in range(len(source))]


def test_split_is_deterministic_disjoint_and_complete(data_config, small_source_dir):
  train = {d["path"].decode() for d in _documents(data_config, "train")}
  validation = {d["path"].decode() for d in _documents(data_config, "validation")}
  expected = set(python_stdlib.list_source_files(small_source_dir))
  assert len(expected) == 12 and not any("__pycache__" in p for p in expected)
  assert train | validation == expected and not train & validation and validation
  assert python_stdlib.split_files(sorted(expected)) == (sorted(train), sorted(validation))


def test_split_membership_depends_only_on_the_path():
  names = [f"lib/module_{i}.py" for i in range(400)]
  train, validation = python_stdlib.split_files(names)
  assert 5 <= len(validation) <= 40  # ~5%
  # Adding files never moves an existing file to the other split.
  train2, validation2 = python_stdlib.split_files(names + [f"new/extra_{i}.py" for i in range(50)])
  assert set(validation) <= set(validation2) and set(train) <= set(train2)


def test_documents_are_the_files(data_config, small_source_dir):
  for doc in _documents(data_config, "train"):
    with open(os.path.join(small_source_dir, doc["path"].decode()), encoding="utf-8") as f:
      assert doc["text"].decode() == f.read()


def test_packing_reproduces_the_token_stream(data_config):
  documents = _documents(data_config, "validation")
  stream = np.concatenate(
      [[TOKENIZER.bos_id, *TOKENIZER.encode(d["text"].decode()), TOKENIZER.eos_id] for d in documents])
  data_config.batch_size = 1
  iterator = make_lm_iterator(data_config, TOKENIZER, split="validation", shuffle=False,
                              process_index=0, process_count=1)
  windows = []
  while sum(len(w) for w in windows) < 2 * len(stream):
    batch = next(iterator)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    windows.append(np.concatenate([batch["inputs"][0], batch["targets"][0, -1:]]))
  # Windows of seq_len + 1 tokens tile the (repeated) stream with no gap or overlap.
  np.testing.assert_array_equal(np.concatenate(windows)[: 2 * len(stream)], np.tile(stream, 2))


def test_shuffling_is_seeded(data_config):
  def first_batches(seed, count=4):
    data_config.shuffle_seed = seed
    it = make_lm_iterator(data_config, TOKENIZER, split="train", shuffle=True, process_index=0, process_count=1)
    return np.stack([next(it)["inputs"] for _ in range(count)])

  np.testing.assert_array_equal(first_batches(1), first_batches(1))
  assert not np.array_equal(first_batches(1), first_batches(2))


def test_processes_read_disjoint_documents(data_config):
  data_config.batch_size = 2
  seen = []
  for index in range(2):
    it = make_lm_iterator(data_config, TOKENIZER, split="train", shuffle=True, process_index=index, process_count=2)
    batch = next(it)
    assert batch["inputs"].shape == (1, 16)
    text = TOKENIZER.decode(np.concatenate([next(it)["inputs"][0] for _ in range(30)]))
    seen.append({line.split("(")[0] for line in text.splitlines() if line.startswith("def f")})
  assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_iterator_state_round_trip(data_config):
  it = make_lm_iterator(data_config, TOKENIZER, split="train", shuffle=True, process_index=0, process_count=1)
  for _ in range(5):
    next(it)
  state = it.get_state()
  expected = [next(it)["inputs"] for _ in range(7)]
  fresh = make_lm_iterator(data_config, TOKENIZER, split="train", shuffle=True, process_index=0, process_count=1)
  fresh.set_state(state)
  for batch in expected:
    np.testing.assert_array_equal(next(fresh)["inputs"], batch)


@pytest.mark.parametrize("field, value, match", [
    ("batch_size", 3, "data.batch_size"),
    ("seq_len", 0, "data.seq_len"),
])
def test_bad_batching(data_config, field, value, match):
  data_config[field] = value
  with pytest.raises(ValueError, match=match):
    make_lm_iterator(data_config, TOKENIZER, split="train", shuffle=True, process_index=0, process_count=2)


def test_bad_dataset_split_and_corpus(data_config, tmp_path):
  with pytest.raises(ValueError, match="Unknown dataset 'no_such_dataset_xyz'.*data.dataset"):
    get_builder("no_such_dataset_xyz", str(tmp_path))
  with pytest.raises(ValueError, match="no split 'test'.*available"):
    get_data_source("python_stdlib", "test", data_config.data_dir, data_config.source_dir)
  empty = tmp_path / "empty"
  empty.mkdir()
  (empty / "README.txt").write_text("no python here")
  with pytest.raises(ValueError, match="corpus would be empty"):
    get_builder("python_stdlib", str(tmp_path / "tfds"), str(empty))
  with pytest.raises(ValueError, match="does not exist"):
    get_builder("python_stdlib", str(tmp_path / "tfds"), str(tmp_path / "missing"))


def test_real_stdlib_corpus(stdlib_data_dir):
  builder = get_builder("python_stdlib", stdlib_data_dir)
  splits = builder.info.splits
  assert splits["train"].num_examples > 1000 and splits["validation"].num_examples > 20
  source = builder.as_data_source("validation")
  assert sum(len(source[i]["text"]) for i in range(len(source))) > 200_000
