"""Multi-query associative recall (data.task="mqar"), as in the Zoology and Based
papers (Arora et al., 2023, 2024): key-value pairs, then some keys again, each
followed by its value:

    <bos> d:4 a:7 k:1 b:0 k:1 d:4

or, with layout="compact", each key right before its value, as in Zoology:

    <bos>d4a7k1b0k1d4

How an example is drawn (knobs under data.mqar, all checked by `Knobs.from_config`):
- `pairs` distinct keys drawn from the first `key_vocab` names of a, b, ..., z, aa,
  ..., zz, aaa, ..., zzz, each with a value uniform in [0, value_vocab) written with a
  fixed number of digits (values may repeat; keys do not);
- `queries` distinct keys among the pairs that at least `distance` pairs follow
  (distance=0: any pair), in random order, each followed by its value (the answer).

Measures per query (`TaskExample.measures`), for accuracy by bucket:
- distance: how many pairs follow the queried pair (>= the `distance` knob; the
  queries before it are not counted);
- token_distance: tokens from the pair's value to the answer (first token to first token);
- order: the query's place among the queries (0: the first). Queries are distinct keys, so a
  late query can be answered by elimination among the values not yet answered, without
  recalling anything (the last of `queries` = `pairs` always can): order 0 measures recall.
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
  require_int,
  unknown_keys,
)

NAME = "mqar"
PUNCTUATION = ":"
# "colon": " d:4", the value two tokens after its one-letter key (byte tokenizer); "compact":
# "d4", the value right after the key, which full attention learned to look up in CPU probes
# where it did not with "colon" (docs/reproduction.md).
LAYOUTS = ("colon", "compact")


@dataclasses.dataclass(frozen=True)
class Knobs:
  """data.mqar.*, with their defaults (train/config.py takes them from here)."""

  pairs: int = 16  # key-value pairs per example, in [1, key_vocab]
  key_vocab: int = 26  # keys are drawn from the first key_vocab of a..z, aa..zz, aaa..zzz; <= 18,278
  queries: int = 4  # distinct keys queried after the pairs
  distance: int = 0  # at least this many pairs follow each queried pair; 0: any
  value_vocab: int = 10  # values 0..value_vocab-1, zero-padded to one width; in [2, 10,000]
  layout: str = "colon"  # one of LAYOUTS: " d:4" or "d4"

  @classmethod
  def from_config(cls, section: Mapping) -> Knobs:
    """The knobs of `section` (data.mqar), or ValueError naming the first bad one."""
    given = {key: section[key] for key in section.keys()}
    key = lambda name: f"data.{NAME}.{name}"
    unknown_keys(f"data.{NAME}", list(given), [f.name for f in dataclasses.fields(cls)])
    k = cls(**given)
    if k.layout not in LAYOUTS:
      raise ValueError(f"{key('layout')} must be one of {LAYOUTS}, got {k.layout!r}")
    require_int(key("key_vocab"), k.key_vocab, 1, NAME_POOL)
    require_int(key("pairs"), k.pairs, 1, k.key_vocab, f" (at most data.{NAME}.key_vocab={k.key_vocab})")
    require_int(key("value_vocab"), k.value_vocab, 2, MAX_VALUE_VOCAB)
    require_int(key("distance"), k.distance, 0, k.pairs - 1, f" (below data.{NAME}.pairs={k.pairs})")
    require_int(
      key("queries"), k.queries, 1, k.pairs - k.distance, f" (at most pairs - distance = {k.pairs} - {k.distance})"
    )
    return k


def make_text(tokenizer, knobs: Knobs) -> TaskText:
  compact = knobs.layout == "compact"
  return TaskText(tokenizer, knobs.key_vocab, knobs.value_vocab, PUNCTUATION, name_prefix="" if compact else " ")


def _separator(text: TaskText, knobs: Knobs) -> np.ndarray:
  """The tokens between a key and its value."""
  return np.zeros(0, np.int32) if knobs.layout == "compact" else text.punctuation[":"]


def max_prompt_tokens(text: TaskText, knobs: Knobs) -> int:
  """An upper bound on a prompt's tokens (BOS and answers included), reached when every
  key and value takes the most tokens any takes."""
  item = text.max_name_tokens + len(_separator(text, knobs)) + text.max_value_tokens
  return 1 + (knobs.pairs + knobs.queries) * item


def make_example(text: TaskText, knobs: Knobs, rng: np.random.Generator) -> TaskExample:
  """One prompt drawn with `rng` (see the module docstring)."""
  k = knobs
  keys = rng.choice(k.key_vocab, size=k.pairs, replace=False)
  values = rng.integers(k.value_vocab, size=k.pairs)
  queried = rng.choice(k.pairs - k.distance, size=k.queries, replace=False)
  colon = _separator(text, knobs)
  prompt = PromptBuilder(text.bos_id)
  value_starts = np.zeros(k.pairs, np.int64)
  for pair, (key, value) in enumerate(zip(keys, values)):
    prompt.add(text.names[key], colon)
    value_starts[pair] = prompt.add(text.values[value])
  answer_starts = np.zeros(k.queries, np.int32)
  answer_lengths = np.zeros(k.queries, np.int32)
  for q, pair in enumerate(queried):
    prompt.add(text.names[keys[pair]], colon)
    answer_starts[q] = prompt.add(text.values[values[pair]])
    answer_lengths[q] = len(text.values[values[pair]])
  return TaskExample(
    tokens=prompt.tokens(),
    answer_starts=answer_starts,
    answer_lengths=answer_lengths,
    measures={
      "distance": (k.pairs - 1 - queried).astype(np.int32),
      "token_distance": (answer_starts - value_starts[queried]).astype(np.int32),
      "order": np.arange(k.queries, dtype=np.int32),
    },
  )
