"""A grain stream of mechanism-task examples (data.task="variable_tracking" or "mqar"),
generated on the fly from nothing but the seed: no corpus is read.

Example `i` of a split is a pure function of (data.shuffle_seed, split name, i) and the
task's knobs (data.<task>.*), so train and eval splits differ, a run is reproducible,
and the stream is a grain MapDataset over example indices whose iterator state is just
the next index: a checkpoint resumes exactly where it stopped. Each prompt (BOS, the
task's statements, the queries with their answers; `castle_jax.data.variable_tracking`,
`castle_jax.data.mqar`) is right-padded with the pad id to seq_len + 1 tokens and split
into the shifted pair; every target that is not an answer token is the pad id, which
the loss ignores, so the loss is on the answers only.

`task_examples` draws examples of a split for evaluation (`castle_jax.eval.tasks`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import grain
import numpy as np

from castle_jax.data import mqar, variable_tracking
from castle_jax.data.passkey_data import split_salt
from castle_jax.data.task_prompts import TaskExample, TaskText
from castle_jax.data.tokenizer import Tokenizer

TASKS = {variable_tracking.NAME: variable_tracking, mqar.NAME: mqar}
# The knobs that make prompts longer, named when data.seq_len is too short.
_LENGTH_KNOBS = {variable_tracking.NAME: ("assignments", "queries"), mqar.NAME: ("pairs", "queries")}
_INDICES = 2**62  # "forever": a MapDataset needs a length


def default_knobs(task: str) -> dict[str, Any]:
  """The task's knobs with their defaults (the data.<task> section of the config schema)."""
  return dataclasses.asdict(TASKS[task].Knobs())


def parse_knobs(task: str, section: Mapping):
  """The task's knobs from `section` (data.<task>), or ValueError naming the first bad one."""
  if task not in TASKS:
    raise ValueError(f"task must be one of {tuple(TASKS)}, got {task!r}")
  return TASKS[task].Knobs.from_config(section)


@functools.lru_cache(maxsize=8)
def _text(tokenizer: Tokenizer, task: str, knobs) -> TaskText:
  return TASKS[task].make_text(tokenizer, knobs)


class TaskGenerator:
  """(split, index) -> TaskExample for one task, tokenizer and set of knobs (picklable).
  Raises ValueError if the tokenizer does not encode the prompts piece by piece
  (`TaskText.check_piecewise`)."""

  def __init__(self, task: str, tokenizer: Tokenizer, knobs, seed: int):
    self.task, self.knobs, self.seed = task, knobs, seed
    self.text = _text(tokenizer, task, knobs)
    self.max_prompt_tokens = TASKS[task].max_prompt_tokens(self.text, knobs)
    self.text.check_piecewise(tokenizer, self.example("check", 0).tokens, task)

  def example(self, split: str, index: int) -> TaskExample:
    rng = np.random.default_rng([self.seed, split_salt(split), int(index)])
    return TASKS[self.task].make_example(self.text, self.knobs, rng)


def check_task_config(data_config, tokenizer: Tokenizer) -> TaskGenerator:
  """Raises ValueError naming the data.<task> knob (or data.seq_len, or the tokenizer)
  that cannot work; reads no data. Returns the example generator."""
  task = data_config.task
  generator = TaskGenerator(task, tokenizer, parse_knobs(task, data_config[task]), data_config.shuffle_seed)
  need = generator.max_prompt_tokens
  if data_config.seq_len + 1 < need:
    raise ValueError(
      f"data.seq_len ({data_config.seq_len}) is too short for data.task={task!r} with these data.{task} knobs: "
      f"a prompt takes up to {need} tokens (BOS and answers included), so it needs seq_len >= {need - 1}; raise "
      f"data.seq_len or lower {' or '.join(f'data.{task}.{knob}' for knob in _LENGTH_KNOBS[task])}"
    )
  return generator


class TaskExamples:
  """index -> {"inputs": int32 [seq_len], "targets": int32 [seq_len]} (picklable, for grain workers)."""

  def __init__(self, generator: TaskGenerator, seq_len: int, split: str):
    self.generator, self.seq_len, self.split = generator, seq_len, split

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    example = self.generator.example(self.split, index)
    pad_id = self.generator.text.pad_id
    window = np.full(self.seq_len + 1, pad_id, np.int32)
    window[: len(example.tokens)] = example.tokens
    targets = np.where(example.answer_mask(self.seq_len + 1)[1:], window[1:], pad_id).astype(np.int32)
    return {"inputs": window[:-1], "targets": targets}


def make_task_dataset(
  data_config, tokenizer: Tokenizer, *, split: str, process_index: int, process_count: int
) -> grain.MapDataset:
  """Batches of the task's examples for this process (see the module docstring).

  Args:
    data_config: `config.data` (task, seq_len, batch_size (global), shuffle_seed, <task>.*).
    tokenizer: encodes names, values and punctuation.
    split: its name salts the seeds, so that splits get different examples.
    process_index, process_count: this process reads examples process_index::process_count.

  Returns:
    A MapDataset of {"inputs": int32 [batch_size // process_count, seq_len],
    "targets": int32 [batch_size // process_count, seq_len]}.
  """
  examples = TaskExamples(check_task_config(data_config, tokenizer), data_config.seq_len, split)
  ds = grain.MapDataset.range(_INDICES)[process_index::process_count].map(examples)
  return ds.batch(data_config.batch_size // process_count, drop_remainder=True)


def task_examples(task: str, tokenizer: Tokenizer, knobs, count: int, *, seed: int, split: str) -> list[TaskExample]:
  """Examples 0..count-1 of `split` under `seed` (any length: no data.seq_len applies)."""
  generator = TaskGenerator(task, tokenizer, knobs, seed)
  return [generator.example(split, index) for index in range(count)]
