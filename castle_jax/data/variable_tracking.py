"""Variable tracking with overwrites (data.task="variable_tracking"): a stream of
assignments in which a name may be reassigned, then queries of the latest value of
some names, as in the CASTLE slides' "x = 1; y = 2; x = 3; x = ?":

    <bos> c=4; a=7; c=1; b=0; a=2; c?1; a?2;

A causal model reading "c=4" cannot know yet that c will be reassigned; the query
must find the latest assignment among several of the same name.

How an example is drawn (knobs under data.variable_tracking, all checked by
`Knobs.from_config`):
- `names` distinct names are drawn from the first `name_vocab` names of a, b, ..., z,
  aa, ..., zz, aaa, ..., zzz; they enter the stream in that random order.
- `assignments` statements `<name>=<value>;`. Each one reassigns a name already
  assigned with probability `overwrite_rate` (uniform among those names), else assigns
  the next new name. Two rules override the coin: once all `names` are assigned every
  statement reassigns (so the realized rate exceeds the knob when names are few), and
  a new name is forced while the stream would otherwise end with fewer than `queries`
  queryable names. overwrite_rate=0 is the control: every name is assigned once (it
  needs assignments <= names). A reassignment always changes the value.
- Values are uniform in [0, value_vocab), written with a fixed number of digits.
- `queries` distinct names are queried, `<name>?<value>;`, in random order, each
  answered with its latest value. They are drawn uniformly among the names whose
  latest assignment is followed by at least `distance` assignments: the last
  `distance` statements only assign names that are not queried (distance=0: any name).

Measures per query (`TaskExample.measures`), for accuracy by bucket:
- overwrites: how many times the queried name was assigned before its latest value
  (0: assigned once);
- distance: how many assignments follow the latest assignment of the queried name
  (>= the `distance` knob; the queries before it are not counted);
- token_distance: tokens from the latest value's first token to the answer's first
  token (what a sliding window must span).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from castle_jax.data.task_prompts import (
  MAX_VALUE_VOCAB,
  NAME_POOL,
  PromptBuilder,
  TaskExample,
  TaskText,
  require_fraction,
  require_int,
  unknown_keys,
)

NAME = "variable_tracking"
PUNCTUATION = "=;?"


@dataclasses.dataclass(frozen=True)
class Knobs:
  """data.variable_tracking.*, with their defaults (train/config.py takes them from here)."""

  names: int = 16  # distinct names per example, in [1, name_vocab]
  name_vocab: int = 26  # names are drawn from the first name_vocab of a..z, aa..zz, aaa..zzz; <= 18,278
  assignments: int = 24  # statements before the queries, >= 1 (<= names when overwrite_rate = 0)
  overwrite_rate: float = 0.5  # probability that a statement reassigns a name; 0: the no-overwrite control
  queries: int = 4  # distinct names queried at the end
  distance: int = 0  # the last `distance` assignments never assign a queried name; 0: any
  value_vocab: int = 10  # values 0..value_vocab-1, zero-padded to one width; in [2, 10,000]

  @classmethod
  def from_config(cls, section: Mapping) -> Knobs:
    """The knobs of `section` (data.variable_tracking), or ValueError naming the first bad one."""
    given = {key: section[key] for key in section.keys()}
    key = lambda name: f"data.{NAME}.{name}"
    unknown_keys(f"data.{NAME}", list(given), [f.name for f in dataclasses.fields(cls)])
    k = cls(**given)
    require_int(key("name_vocab"), k.name_vocab, 1, NAME_POOL)
    require_int(key("names"), k.names, 1, k.name_vocab, f" (at most data.{NAME}.name_vocab={k.name_vocab})")
    require_int(key("value_vocab"), k.value_vocab, 2, MAX_VALUE_VOCAB)
    require_fraction(key("overwrite_rate"), k.overwrite_rate)
    if k.overwrite_rate == 0:
      require_int(
        key("assignments"),
        k.assignments,
        1,
        k.names,
        f" (with overwrite_rate=0 each name is assigned once: at most data.{NAME}.names={k.names})",
      )
    else:
      require_int(key("assignments"), k.assignments, 1)
    # A distance needs a name that is never queried for the last statements to assign.
    require_int(
      key("distance"),
      k.distance,
      0,
      k.assignments - 1 if k.names > 1 else 0,
      f" (below data.{NAME}.assignments={k.assignments}; 0 when data.{NAME}.names=1)",
    )
    most = min(k.names - (k.distance > 0), k.assignments - k.distance)
    require_int(
      key("queries"),
      k.queries,
      1,
      most,
      f" (distinct names assigned before the last distance={k.distance} statements: at most "
      f"names{' - 1' if k.distance else ''} and assignments - distance)",
    )
    return k


def make_text(tokenizer, knobs: Knobs) -> TaskText:
  return TaskText(tokenizer, knobs.name_vocab, knobs.value_vocab, PUNCTUATION)


def max_prompt_tokens(text: TaskText, knobs: Knobs) -> int:
  """An upper bound on a prompt's tokens (BOS and answers included), reached when every
  name and value takes the most tokens any takes."""
  p = {c: len(ids) for c, ids in text.punctuation.items()}
  item = text.max_name_tokens + text.max_value_tokens + p[";"]
  return 1 + knobs.assignments * (item + p["="]) + knobs.queries * (item + p["?"])


def make_example(text: TaskText, knobs: Knobs, rng: np.random.Generator) -> TaskExample:
  """One prompt drawn with `rng` (see the module docstring)."""
  k = knobs
  pool = rng.choice(k.name_vocab, size=k.names, replace=False)  # local name j is pool[j]
  times_assigned = np.zeros(k.names, np.int64)
  value = np.full(k.names, -1, np.int64)
  last_statement = np.zeros(k.names, np.int64)
  value_start = np.zeros(k.names, np.int64)
  prompt = PromptBuilder(text.bos_id)
  equals, semicolon, question = (text.punctuation[c] for c in "=;?")
  head = k.assignments - k.distance  # the queried names are among those assigned here
  reassignable: list[int] = []  # assigned names the current statement may reassign
  queried = None
  assigned = 0  # local names 0..assigned-1 have a value
  for statement in range(k.assignments):
    if statement == head:
      queried = rng.choice(assigned, size=k.queries, replace=False)
      reassignable = sorted(set(range(assigned)) - set(queried.tolist()))
    can_add = assigned < k.names
    must_add = queried is None and assigned + (head - statement) <= k.queries
    if reassignable and not must_add and (not can_add or rng.random() < k.overwrite_rate):
      name = reassignable[int(rng.integers(len(reassignable)))]
      new = int(rng.integers(k.value_vocab - 1))
      value[name] = new + (new >= value[name])  # any value but the current one
    else:
      name, assigned = assigned, assigned + 1
      value[name] = rng.integers(k.value_vocab)
      reassignable.append(name)
    times_assigned[name] += 1
    last_statement[name] = statement
    prompt.add(text.names[pool[name]], equals)
    value_start[name] = prompt.add(text.values[value[name]], semicolon)
  if queried is None:
    queried = rng.choice(assigned, size=k.queries, replace=False)
  answer_starts = np.zeros(k.queries, np.int32)
  answer_lengths = np.zeros(k.queries, np.int32)
  for q, name in enumerate(queried):
    prompt.add(text.names[pool[name]], question)
    answer_starts[q] = prompt.add(text.values[value[name]])
    answer_lengths[q] = len(text.values[value[name]])
    prompt.add(semicolon)
  return TaskExample(
    tokens=prompt.tokens(),
    answer_starts=answer_starts,
    answer_lengths=answer_lengths,
    measures={
      "overwrites": (times_assigned[queried] - 1).astype(np.int32),
      "distance": (k.assignments - 1 - last_statement[queried]).astype(np.int32),
      "token_distance": (answer_starts - value_start[queried]).astype(np.int32),
    },
  )
