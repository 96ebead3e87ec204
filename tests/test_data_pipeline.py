"""The python_stdlib TFDS corpus and the grain LM pipeline."""

import contextlib
import copy
import os
import shutil
import time

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
    [[TOKENIZER.bos_id, *TOKENIZER.encode(d["text"].decode()), TOKENIZER.eos_id] for d in documents]
  )
  data_config.batch_size = 1
  iterator = make_lm_iterator(
    data_config, TOKENIZER, split="validation", shuffle=False, process_index=0, process_count=1
  )
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


@pytest.mark.parametrize(
  "field, value, match",
  [
    ("batch_size", 3, "data.batch_size"),
    ("seq_len", 0, "data.seq_len"),
  ],
)
def test_bad_batching(data_config, field, value, match):
  data_config[field] = value
  with pytest.raises(ValueError, match=match):
    make_lm_iterator(data_config, TOKENIZER, split="train", shuffle=True, process_index=0, process_count=2)


def test_bad_dataset_split_and_corpus(data_config, tmp_path):
  with pytest.raises(ValueError, match="Unknown dataset 'no_such_dataset_xyz'.*data.dataset"):
    get_builder("no_such_dataset_xyz", str(tmp_path))
  with pytest.raises(ValueError, match="no split 'test'.*available"):
    get_data_source("python_stdlib", "test", data_config.data_dir, data_config.source_dir)


def _tree(root, files):
  for relative, content in files.items():
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return root


@pytest.mark.parametrize(
  "files, match",
  [
    (None, "does not exist"),
    ({}, "no .py files: the corpus would be empty"),
    ({"README.txt": "no python here"}, "no .py files: the corpus would be empty"),
    ({"only.py": "x = 1\n"}, "only one .py file \\(only.py\\)"),
    ({"a.py": b"\xff\xfe\x00binary", "b.py": b"\x80\x81"}, "0 usable"),
    ({"a.py": "x = 1\n", "b.py": b"\x80\x81", "c.py": ""}, "1 usable"),
  ],
)
def test_bad_corpora_are_one_line_errors_and_leave_no_cache(tmp_path, files, match):
  source = tmp_path / "src"
  if files is not None:
    _tree(source, files) if files else source.mkdir()
  data_dir = tmp_path / "tfds"
  with (
    pytest.warns(UserWarning, match="not UTF-8")
    if files and any(isinstance(v, bytes) for v in files.values())
    else contextlib.nullcontext()
  ):
    with pytest.raises(ValueError, match="data.source_dir .*" + match) as error:
      get_builder("python_stdlib", str(data_dir), str(source))
  assert "\n" not in str(error.value)
  assert not os.path.exists(data_dir)  # no (empty) cache folder is left behind


def test_corpus_cache_follows_the_directory_contents(tmp_path, small_source_dir):
  source = tmp_path / "src"
  shutil.copytree(small_source_dir, source)
  data_dir = str(tmp_path / "tfds")

  def documents():
    builder = get_builder("python_stdlib", data_dir, str(source))
    return builder.builder_config.name, sum(builder.info.splits[s].num_examples for s in ("train", "validation"))

  name, count = documents()
  assert count == 12 and documents() == (name, count)  # unchanged: the cache is reused
  (source / "pkg0" / "added.py").write_text("def added():\n    return 1\n")
  name2, count2 = documents()
  assert count2 == 13 and name2 != name
  (source / "pkg0" / "module_0.py").unlink()
  name3, count3 = documents()
  assert count3 == 12 and name3 not in (name, name2)
  (source / "pkg0" / "added.py").write_text("def added():\n    return 2  # edited\n")
  name4, _ = documents()
  assert name4 != name3
  # Old caches are kept (nothing is deleted).
  assert {name, name2, name3, name4} <= set(os.listdir(os.path.join(data_dir, "python_stdlib")))


def test_non_utf8_files_are_reported_and_left_out(tmp_path, small_source_dir):
  source = tmp_path / "src"
  shutil.copytree(small_source_dir, source)
  (source / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))
  (source / "pkg1" / "blob.py").write_bytes(bytes(range(256)))
  with pytest.warns(UserWarning, match=r"2 \.py file\(s\) .*not UTF-8.*latin1.py|2 \.py file\(s\) .*pkg1/blob.py"):
    builder = get_builder("python_stdlib", str(tmp_path / "tfds"), str(source))
  assert builder.info.splits["train"].num_examples + builder.info.splits["validation"].num_examples == 12


def test_real_stdlib_corpus(stdlib_data_dir):
  builder = get_builder("python_stdlib", stdlib_data_dir)
  splits = builder.info.splits
  assert splits["train"].num_examples > 1000 and splits["validation"].num_examples > 20
  source = builder.as_data_source("validation")
  assert sum(len(source[i]["text"]) for i in range(len(source))) > 200_000


@pytest.mark.parametrize("worker_count", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_prefetch_keeps_the_batches_and_the_resume_position(data_config, worker_count):
  if worker_count:
    from absl import flags

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()  # grain's worker processes read absl flags (`python -m train` parses them)

  def iterator(prefetch):
    data_config.worker_count = worker_count
    return make_lm_iterator(
      data_config, TOKENIZER, split="train", shuffle=True, process_index=0, process_count=1, prefetch=prefetch
    )

  plain = iterator(0)
  expected = [next(plain)["inputs"] for _ in range(12)]
  plain.close()
  ahead = iterator(3)
  for batch in expected[:5]:
    np.testing.assert_array_equal(next(ahead)["inputs"], batch)
  time.sleep(0.2)  # let the thread read ahead past the consumed position
  state = ahead.get_state()
  ahead.close()
  resumed = iterator(3)
  resumed.set_state(state)
  for batch in expected[5:]:
    np.testing.assert_array_equal(next(resumed)["inputs"], batch)
  resumed.close()


def test_processes_started_together_share_one_build(tmp_path, small_source_dir):
  # Each process builds the corpus into the same fresh data_dir; without the build lock
  # one process's failed attempt removed the folder another was writing.
  import subprocess
  import sys

  script = (
    "import sys; from castle_jax.data.pipeline import get_builder; "
    "b = get_builder('python_stdlib', sys.argv[1], sys.argv[2]); "
    "print(sum(b.info.splits[s].num_examples for s in ('train', 'validation')))"
  )
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
  processes = [
    subprocess.Popen(
      [sys.executable, "-c", script, str(tmp_path / "tfds"), small_source_dir],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    )
    for _ in range(3)
  ]
  results = [p.communicate(timeout=300) for p in processes]
  for process, (out, err) in zip(processes, results):
    assert process.returncode == 0, err[-2000:]
    assert out.split()[-1] == "12"


def test_building_the_local_corpus_does_not_claim_a_download(tmp_path, small_source_dir, capfd):
  get_builder("python_stdlib", str(tmp_path / "tfds"), small_source_dir)
  out, err = capfd.readouterr()
  assert "Download" not in out + err and "Unknown size" not in out + err
  assert f"Building the python_stdlib corpus from {small_source_dir} into" in err
  get_builder("python_stdlib", str(tmp_path / "tfds"), small_source_dir)  # built: silent
  out, err = capfd.readouterr()
  assert "Building" not in out + err
