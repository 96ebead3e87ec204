"""The mechanism-task streams (data.task="variable_tracking" and "mqar"): every answer
recomputed from the prompt's text by an independent parser, answer-only targets,
determinism, exact resume, byte and BPE tokenizers, and one-line errors for bad knobs."""

import copy
import re

import numpy as np
import pytest

from castle_jax.data import task_data
from castle_jax.data.pipeline import make_lm_iterator
from castle_jax.data.task_prompts import NAME_POOL, name_text
from castle_jax.data.tokenizer import ByteTokenizer, train_bpe_tokenizer
from train.config import base_config

BYTES = ByteTokenizer()
TASKS = ("variable_tracking", "mqar")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A byte-level BPE whose merges join multi-letter names and multi-digit values."""
  corpus = [" ab=12; cd=345; ab?12; xyz:0042 qq:7 " * 20, "def f(x):\n    return x + 1\n" * 20]
  return train_bpe_tokenizer(corpus, vocab_size=320, path=str(tmp_path_factory.mktemp("bpe") / "tok.json"))


def _data_config(task, seq_len=None, **knobs):
  c = copy.deepcopy(base_config().data)
  c.task, c.batch_size = task, 4
  c.dataset, c.data_dir = "no_such_dataset", "/nonexistent"  # the tasks read no corpus
  for key, value in knobs.items():
    c[task][key] = value
  generator = task_data.TaskGenerator(task, BYTES, task_data.parse_knobs(task, c[task]), 0)
  c.seq_len = seq_len or generator.max_prompt_tokens - 1
  return c


def _iterator(data_config, tokenizer=BYTES, split="train", process_index=0, process_count=1):
  return make_lm_iterator(
    data_config, tokenizer, split=split, shuffle=True, process_index=process_index, process_count=process_count
  )


def _batches(data_config, count=3, **kwargs):
  it = _iterator(data_config, **kwargs)
  batches = [next(it) for _ in range(count)]
  it.close()
  return batches


# --- An independent oracle: parse the prompt's text and recompute every answer. ---

_STATEMENT = re.compile(r" ([a-z]+)([=?:])([0-9]+)")


def _parse(text):
  """[(name, operator, value)] of a prompt's text, which must be nothing but statements."""
  statements = _STATEMENT.findall(text.replace(";", ""))
  rebuilt = "".join(f" {n}{op}{v}" for n, op, v in statements)
  assert rebuilt == text.replace(";", ""), text
  return statements


def _oracle_variable_tracking(text, knobs):
  """The queries' answers, overwrite counts and distances from the text alone; checks the stream's rules."""
  statements = _parse(text)
  assert text.endswith(";") and text.count(";") == len(statements)
  assignments = [(n, v) for n, op, v in statements if op == "="]
  queries = [(n, v) for n, op, v in statements if op == "?"]
  assert [op for _, op, _ in statements] == ["="] * len(assignments) + ["?"] * len(queries)
  assert len(assignments) == knobs["assignments"] and len(queries) == knobs["queries"]
  names = {n for n, _ in assignments}
  assert len(names) <= knobs["names"]
  assert all(name_index(n) < knobs["name_vocab"] for n in names)
  width = len(str(knobs["value_vocab"] - 1))
  assert all(len(v) == width and int(v) < knobs["value_vocab"] for _, v in assignments + queries)
  latest, count, last = {}, {}, {}
  for i, (n, v) in enumerate(assignments):
    assert latest.get(n) != v, f"a reassignment must change the value: {text}"
    latest[n], count[n], last[n] = v, count.get(n, 0) + 1, i
  if knobs["overwrite_rate"] == 0:
    assert max(count.values()) == 1
  assert len({n for n, _ in queries}) == len(queries)
  expected = []
  for n, v in queries:
    assert v == latest[n], f"{n}?{v} but the latest {n} is {latest[n]}: {text}"
    expected.append((count[n] - 1, len(assignments) - 1 - last[n]))
  return [v for _, v in queries], expected


def _oracle_mqar(text, knobs):
  statements = _parse(text)
  assert {op for _, op, _ in statements} == {":"}
  pairs, queries = statements[: knobs["pairs"]], statements[knobs["pairs"] :]
  assert len(queries) == knobs["queries"]
  keys = [n for n, _, _ in pairs]
  assert len(set(keys)) == len(keys) and all(name_index(n) < knobs["key_vocab"] for n in keys)
  value_of = {n: v for n, _, v in pairs}
  assert len({n for n, _, _ in queries}) == len(queries)
  expected = []
  for n, _, v in queries:
    assert v == value_of[n]
    expected.append((len(pairs) - 1 - keys.index(n),))
  return [v for _, _, v in queries], expected


def name_index(name):
  """The index of `name` in a..z, aa..zz, aaa..zzz, recomputed without the generator."""
  offset = sum(26**w for w in range(1, len(name)))
  return offset + int("".join("0123456789abcdefghijklmnop"["abcdefghijklmnopqrstuvwxyz".index(c)] for c in name), 26)


def test_name_order():
  assert [name_text(i) for i in (0, 25, 26, 27, 701, 702, NAME_POOL - 1)] == ["a", "z", "aa", "ab", "zz", "aaa", "zzz"]
  assert all(name_index(name_text(i)) == i for i in range(0, NAME_POOL, 97))


SETTINGS = {
  "variable_tracking": [
    {},  # the defaults
    dict(names=12, assignments=12, overwrite_rate=0.0, queries=5),  # the control: no overwrites
    dict(names=12, assignments=10, overwrite_rate=0.0, queries=3, distance=6),
    dict(names=3, assignments=40, overwrite_rate=0.9, queries=3),  # heavy overwrites, names run out
    dict(names=4, assignments=30, overwrite_rate=1.0, queries=3, distance=20),
    dict(names=40, name_vocab=800, assignments=60, overwrite_rate=0.3, queries=8, distance=5, value_vocab=1000),
    dict(names=1, assignments=5, overwrite_rate=0.5, queries=1),
  ],
  "mqar": [
    {},
    dict(pairs=30, key_vocab=30, queries=30),
    dict(pairs=40, key_vocab=18278, queries=6, distance=30, value_vocab=10000),
    dict(pairs=1, queries=1, value_vocab=2),
  ],
}
CASES = [(task, knobs) for task in TASKS for knobs in SETTINGS[task]]


@pytest.mark.parametrize("tokenizer_name", ["byte", "bpe"])
@pytest.mark.parametrize("task, knobs", CASES)
def test_answers_are_the_latest_values_by_an_independent_oracle(task, knobs, tokenizer_name, bpe):
  tokenizer = BYTES if tokenizer_name == "byte" else bpe
  full = {**task_data.default_knobs(task), **knobs}
  generator = task_data.TaskGenerator(task, tokenizer, task_data.parse_knobs(task, full), seed=7)
  oracle = _oracle_variable_tracking if task == "variable_tracking" else _oracle_mqar
  for index in range(60):
    example = generator.example("train", index)
    text = tokenizer.decode(example.tokens)
    # The tokens are the text's own encoding: the pieces tokenize the same in context.
    np.testing.assert_array_equal(example.tokens, np.concatenate([[tokenizer.bos_id], tokenizer.encode(text)]))
    assert len(example.tokens) <= generator.max_prompt_tokens
    answers, measures = oracle(text, full)
    for q, answer in enumerate(answers):
      start, size = example.answer_starts[q], example.answer_lengths[q]
      assert tokenizer.decode(example.tokens[start : start + size]) == answer
      # The answer follows its query's "?" (":") and is followed by ";" or the next query.
      assert tokenizer.decode(example.tokens[:start]).endswith(("?", ":"))
    if task == "variable_tracking":
      np.testing.assert_array_equal(example.measures["overwrites"], [m[0] for m in measures])
      np.testing.assert_array_equal(example.measures["distance"], [m[1] for m in measures])
    else:
      np.testing.assert_array_equal(example.measures["distance"], [m[0] for m in measures])
      np.testing.assert_array_equal(example.measures["order"], np.arange(len(answers)))
    assert (example.measures["distance"] >= full["distance"]).all()
    for q in range(len(answers)):  # token_distance: from the latest value's first token to the answer's
      value_position = example.answer_starts[q] - example.measures["token_distance"][q]
      assert tokenizer.decode(example.tokens[value_position : value_position + example.answer_lengths[q]]) == answers[q]
      assert tokenizer.decode(example.tokens[:value_position]).endswith(("=", ":"))


@pytest.mark.parametrize("tokenizer_name", ["byte", "bpe"])
@pytest.mark.parametrize("knobs", [{}, dict(pairs=40, key_vocab=800, queries=9, distance=3, value_vocab=1000)])
def test_mqar_compact_layout_is_the_colon_prompt_without_space_and_colon(knobs, tokenizer_name, bpe):
  tokenizer = BYTES if tokenizer_name == "byte" else bpe
  generators = {
    layout: task_data.TaskGenerator(
      "mqar",
      tokenizer,
      task_data.parse_knobs("mqar", {**task_data.default_knobs("mqar"), **knobs, "layout": layout}),
      3,
    )
    for layout in ("colon", "compact")
  }
  assert generators["compact"].max_prompt_tokens < generators["colon"].max_prompt_tokens
  for index in range(20):
    colon, compact = (generators[layout].example("train", index) for layout in ("colon", "compact"))
    text = tokenizer.decode(compact.tokens)
    assert text == tokenizer.decode(colon.tokens).replace(" ", "").replace(":", "")
    np.testing.assert_array_equal(compact.tokens, np.concatenate([[tokenizer.bos_id], tokenizer.encode(text)]))
    assert len(compact.tokens) <= generators["compact"].max_prompt_tokens
    for q in range(len(compact.answer_starts)):
      start, size = compact.answer_starts[q], compact.answer_lengths[q]
      answer = tokenizer.decode(compact.tokens[start : start + size])
      assert answer == tokenizer.decode(colon.tokens[colon.answer_starts[q] : colon.answer_starts[q] + size])
      # The answer directly follows its key's letters, and the first token before it is a letter.
      assert re.fullmatch(r"[0-9]+", answer) and tokenizer.decode(compact.tokens[start - 1 : start])[-1].isalpha()
      value = start - compact.measures["token_distance"][q]
      assert tokenizer.decode(compact.tokens[value : value + size]) == answer
    for name in ("distance", "order"):
      np.testing.assert_array_equal(compact.measures[name], colon.measures[name])


def test_overwrite_rate_is_the_fraction_of_reassignments():
  """With more names than statements only the coin decides (and the first statement is new)."""
  for rate in (0.0, 0.3, 0.8):
    knobs = task_data.parse_knobs(
      "variable_tracking",
      {
        **task_data.default_knobs("variable_tracking"),
        "names": 26,
        "assignments": 21,
        "overwrite_rate": rate,
        "queries": 1,
      },
    )
    generator = task_data.TaskGenerator("variable_tracking", BYTES, knobs, seed=0)
    reassigned = []
    for index in range(300):
      names = [n for n, op, _ in _parse(BYTES.decode(generator.example("train", index).tokens)) if op == "="]
      reassigned += [n in names[:i] for i, n in enumerate(names)][1:]
    assert abs(np.mean(reassigned) - rate) < 0.03, (rate, np.mean(reassigned))


def test_overwrite_counts_grow_with_the_rate():
  means = []
  for rate in (0.2, 0.5, 0.8):
    c = _data_config("variable_tracking", names=20, assignments=20, overwrite_rate=rate, queries=4)
    generator = task_data.check_task_config(c, BYTES)
    means.append(np.mean([generator.example("train", i).measures["overwrites"].mean() for i in range(100)]))
  assert means == sorted(means) and means[0] < 0.5 < 2 < means[-1]


@pytest.mark.parametrize("task", TASKS)
def test_targets_are_the_answer_tokens_only(task):
  c = _data_config(task)
  generator = task_data.check_task_config(c, BYTES)
  batches = _batches(c)
  for b, batch in enumerate(batches):
    assert batch["inputs"].shape == batch["targets"].shape == (4, c.seq_len)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    for row in range(4):
      example = generator.example("train", 4 * b + row)
      window = np.full(c.seq_len + 1, BYTES.pad_id)
      window[: len(example.tokens)] = example.tokens
      np.testing.assert_array_equal(batch["inputs"][row], window[:-1])
      kept = np.flatnonzero(batch["targets"][row] != BYTES.pad_id)
      answers = np.concatenate([np.arange(s, s + n) for s, n in zip(example.answer_starts, example.answer_lengths)])
      np.testing.assert_array_equal(kept, answers - 1)  # target j predicts token j + 1
      np.testing.assert_array_equal(batch["targets"][row][kept], example.tokens[answers])
      assert (batch["inputs"][row][kept] == BYTES.encode("?" if task == "variable_tracking" else ":")[0]).all()


@pytest.mark.parametrize("task", TASKS)
def test_bpe_stream_targets_are_the_answers(task, bpe):
  c = _data_config(task, seq_len=200, **({"value_vocab": 1000} if task == "mqar" else {"name_vocab": 700}))
  for batch in _batches(c, tokenizer=bpe, count=2):
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
      text = bpe.decode(np.append(inputs, targets[-1]))  # the prompt's last token is only a target
      answers = [v for _, _, v in _parse(text)[-c[task].queries :]]
      assert bpe.decode(targets[targets != bpe.pad_id]) == "".join(answers)


def _stack(batches):
  return np.stack([np.concatenate([b["inputs"], b["targets"]]) for b in batches])


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_by_seed_and_split(task):
  c = _data_config(task)
  first = _stack(_batches(c))
  np.testing.assert_array_equal(first, _stack(_batches(c)))
  assert not np.array_equal(first, _stack(_batches(c, split="validation")))
  c.shuffle_seed = 1
  assert not np.array_equal(first, _stack(_batches(c)))
  rows = first.reshape(-1, c.seq_len)
  assert len({row.tobytes() for row in rows}) == len(rows)


@pytest.mark.parametrize("task", TASKS)
def test_iterator_state_resumes_exactly(task):
  c = _data_config(task)
  it = _iterator(c)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(4)]
  it.close()
  fresh = _iterator(c)
  fresh.set_state(state)
  for batch in expected:
    got = next(fresh)
    np.testing.assert_array_equal(got["inputs"], batch["inputs"])
    np.testing.assert_array_equal(got["targets"], batch["targets"])
  fresh.close()


def test_processes_read_alternate_examples():
  c = _data_config("mqar")
  whole = _batches(c, count=2)
  c.batch_size = 8
  shards = [_batches(c, count=1, process_index=i, process_count=2)[0] for i in range(2)]
  examples = np.concatenate([b["inputs"] for b in whole])
  for i, shard in enumerate(shards):
    np.testing.assert_array_equal(shard["inputs"], examples[i::2])


@pytest.mark.parametrize("task", TASKS)
def test_shortest_seq_len_fits_and_one_less_names_the_minimum(task):
  c = _data_config(task)
  shortest = c.seq_len
  for batch in _batches(c):  # byte names of one letter and one-digit values: every prompt is the longest
    assert (batch["inputs"][:, -1] != BYTES.pad_id).all()
  c.seq_len = shortest - 1
  with pytest.raises(
    ValueError, match=rf"data.seq_len \({shortest - 1}\) is too short .* needs seq_len >= {shortest};"
  ):
    _iterator(c)


class _MergingTokenizer(ByteTokenizer):
  """Bytes, except that "; " is one token: it merges across the prompts' pieces."""

  def __init__(self):
    super().__init__()
    self.vocab_size = 260
    self.token_byte_lengths = np.append(self.token_byte_lengths, 2)

  def encode(self, text):
    ids, i = [], 0
    while i < len(text):
      if text.startswith("; ", i):
        ids.append(259)
        i += 2
      else:
        ids.extend(super().encode(text[i]))
        i += 1
    return np.asarray(ids, np.int32)

  def decode(self, ids):
    return "".join("; " if i == 259 else super(_MergingTokenizer, self).decode([i]) for i in np.asarray(ids).ravel())


def test_a_tokenizer_that_merges_across_pieces_is_refused():
  with pytest.raises(ValueError, match="differently as a whole than piece by piece"):
    _iterator(_data_config("variable_tracking"), tokenizer=_MergingTokenizer())


VARIABLE_TRACKING_ERRORS = [
  (dict(name_vocab=0), "name_vocab must be an int in [1, 18278], got 0"),
  (dict(name_vocab=18279), "name_vocab must be an int in [1, 18278], got 18279"),
  (dict(names=0), "names must be an int in [1, 26] (at most data.variable_tracking.name_vocab=26), got 0"),
  (dict(names=27), "names must be an int in [1, 26]"),
  (dict(value_vocab=1), "value_vocab must be an int in [2, 10000], got 1"),
  (dict(value_vocab=10001), "value_vocab must be an int in [2, 10000], got 10001"),
  (dict(overwrite_rate=-0.1), "overwrite_rate must be a number in [0, 1], got -0.1"),
  (dict(overwrite_rate=1.5), "overwrite_rate must be a number in [0, 1], got 1.5"),
  (dict(assignments=0), "assignments must be an int >= 1, got 0"),
  (dict(overwrite_rate=0.0, assignments=17), "assignments must be an int in [1, 16] (with overwrite_rate=0"),
  (dict(distance=-1), "distance must be an int in [0, 23]"),
  (dict(distance=24), "distance must be an int in [0, 23] (below data.variable_tracking.assignments=24"),
  (dict(names=1, queries=1, distance=1), "distance must be an int in [0, 0]"),
  (dict(queries=0), "queries must be an int in [1, 16]"),
  (dict(queries=17), "queries must be an int in [1, 16]"),
  (dict(queries=10, distance=20), "queries must be an int in [1, 4] "),
  (dict(names=4, queries=4, distance=1), "queries must be an int in [1, 3] "),
]
MQAR_ERRORS = [
  (dict(key_vocab=0), "key_vocab must be an int in [1, 18278], got 0"),
  (dict(key_vocab=18279), "key_vocab must be an int in [1, 18278], got 18279"),
  (dict(pairs=0), "pairs must be an int in [1, 26] (at most data.mqar.key_vocab=26), got 0"),
  (dict(pairs=27), "pairs must be an int in [1, 26]"),
  (dict(value_vocab=1), "value_vocab must be an int in [2, 10000], got 1"),
  (dict(distance=-1), "distance must be an int in [0, 15] (below data.mqar.pairs=16), got -1"),
  (dict(distance=16), "distance must be an int in [0, 15]"),
  (dict(queries=0), "queries must be an int in [1, 16] (at most pairs - distance = 16 - 0), got 0"),
  (dict(queries=5, distance=12), "queries must be an int in [1, 4] (at most pairs - distance = 16 - 12), got 5"),
  (dict(layout="spaced"), "layout must be one of ('colon', 'compact'), got 'spaced'"),
]
ERRORS = [("variable_tracking", k, m) for k, m in VARIABLE_TRACKING_ERRORS] + [("mqar", k, m) for k, m in MQAR_ERRORS]


@pytest.mark.parametrize("task, knobs, message", ERRORS)
def test_bad_knobs_are_one_line_naming_the_key_before_any_data(task, knobs, message):
  c = copy.deepcopy(base_config().data)
  c.task, c.dataset = task, "no_such_dataset"  # the knob is checked first: no dataset is looked up
  for key, value in knobs.items():
    c[task][key] = value
  with pytest.raises(ValueError) as raised:
    _iterator(c)
  text = str(raised.value)
  assert f"data.{task}.{message}" in text and "\n" not in text, text
  bad_key = text.split(" must be ")[0]
  assert repr(knobs[bad_key.rsplit(".", 1)[1]]) in text  # names its value


@pytest.mark.parametrize("task", TASKS)
def test_unknown_and_mistyped_knobs(task):
  with pytest.raises(ValueError, match=rf"data.{task} has no key\(s\) \['nmes'\]; the keys are"):
    task_data.parse_knobs(task, {**task_data.default_knobs(task), "nmes": 3})
  with pytest.raises(ValueError, match=rf"data.{task}.queries must be an int in .*, got True"):
    task_data.parse_knobs(task, {**task_data.default_knobs(task), "queries": True})
  with pytest.raises(ValueError, match=r"task must be one of \('variable_tracking', 'mqar'\), got 'vt'"):
    task_data.parse_knobs("vt", {})
