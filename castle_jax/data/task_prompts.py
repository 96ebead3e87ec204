"""What the mechanism tasks (castle_jax.data.variable_tracking, castle_jax.data.mqar) share:
their names and values as token ids, the prompt builder, the example record and the
knob checks.

A prompt is a sequence of pieces: a name with its leading space (" a", " qz"), a value's
digits ("7", "042") and single punctuation characters ("=", ";", "?", ":"). Each piece
is a whole pre-token of a byte-level BPE (GPT-2's split, which
`castle_jax.data.tokenizer.train_bpe_tokenizer` uses: a space joins the letters after
it, and a run of digits and a run of punctuation are pre-tokens of their own), and BPE
merges never cross pre-tokens, so a prompt's tokens are the concatenation of its pieces'
tokens whatever merges the tokenizer learned, and encoding the prompt's text gives the
same ids. `TaskText.check_piecewise` verifies that for the tokenizer at hand.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from castle_jax.data.tokenizer import Tokenizer

LETTERS = "abcdefghijklmnopqrstuvwxyz"
# Names are the lowercase words of 1 to 3 letters in the order a..z, aa..zz, aaa..zzz.
NAME_POOL = 26 + 26**2 + 26**3
MAX_VALUE_VOCAB = 10_000


def name_text(index: int) -> str:
  """The index-th name: 0 -> "a", 25 -> "z", 26 -> "aa", 701 -> "zz", 702 -> "aaa"."""
  if not 0 <= index < NAME_POOL:
    raise ValueError(f"name index {index} is outside [0, {NAME_POOL})")
  width = 1
  while index >= 26**width:
    index -= 26**width
    width += 1
  letters = []
  for _ in range(width):
    index, letter = divmod(index, 26)
    letters.append(LETTERS[letter])
  return "".join(reversed(letters))


def value_text(value: int, value_vocab: int) -> str:
  """`value` in [0, value_vocab) as decimal digits, zero-padded to the width of value_vocab - 1."""
  return str(value).zfill(len(str(value_vocab - 1)))


class TaskText:
  """Token ids of a task's pieces under one tokenizer: names[i] = encode(name_prefix +
  name_text(i)), values[v] = encode(value_text(v, value_vocab)), punctuation[c] = encode(c)."""

  def __init__(self, tokenizer: Tokenizer, name_vocab: int, value_vocab: int, punctuation: str, name_prefix: str = " "):
    self.bos_id, self.pad_id = tokenizer.bos_id, tokenizer.pad_id
    self.names = [tokenizer.encode(name_prefix + name_text(i)).astype(np.int32) for i in range(name_vocab)]
    self.values = [tokenizer.encode(value_text(v, value_vocab)).astype(np.int32) for v in range(value_vocab)]
    self.punctuation = {c: tokenizer.encode(c).astype(np.int32) for c in punctuation}
    self.max_name_tokens = max(len(ids) for ids in self.names)
    self.max_value_tokens = max(len(ids) for ids in self.values)

  def check_piecewise(self, tokenizer: Tokenizer, example_tokens: np.ndarray, task: str) -> None:
    """Raises ValueError unless encoding the text of `example_tokens` (a prompt built from
    this object's pieces) gives the same ids: the tokenizer splits the pieces as a
    byte-level BPE does."""
    text = tokenizer.decode(example_tokens)
    again = np.concatenate([[self.bos_id], tokenizer.encode(text)])
    if not np.array_equal(again, example_tokens):
      raise ValueError(
        f"data.tokenizer tokenizes a {task} prompt ({text[:60]!r}...) differently as a whole than piece by "
        "piece (names, values, punctuation): use the byte tokenizer or a byte-level BPE "
        "(castle_jax.data.tokenizer.train_bpe_tokenizer)"
      )


class PromptBuilder:
  """Concatenates pieces after BOS, remembering where each starts."""

  def __init__(self, bos_id: int):
    self._pieces: list[np.ndarray] = [np.array([bos_id], np.int32)]
    self.length = 1

  def add(self, *pieces: np.ndarray) -> int:
    """Appends the pieces; returns the index of the first one's first token."""
    start = self.length
    for piece in pieces:
      self._pieces.append(piece)
      self.length += len(piece)
    return start

  def tokens(self) -> np.ndarray:
    return np.concatenate(self._pieces)


@dataclasses.dataclass(frozen=True)
class TaskExample:
  """One prompt with its queries' answers at the end.

  tokens: int32 [length]: BOS, then the prompt with every answer in place.
  answer_starts, answer_lengths: int32 [queries]: where each answer's tokens are.
  measures: {name: int32 [queries]} per query, e.g. "distance" and "token_distance"
    (see the task's module) and, for variable tracking, "overwrites".
  """

  tokens: np.ndarray
  answer_starts: np.ndarray
  answer_lengths: np.ndarray
  measures: dict[str, np.ndarray]

  def answer_mask(self, length: int | None = None) -> np.ndarray:
    """bool [length or len(tokens)]: True at answer tokens."""
    mask = np.zeros(len(self.tokens) if length is None else length, bool)
    for start, count in zip(self.answer_starts, self.answer_lengths):
      mask[start : start + count] = True
    return mask


def require_int(key: str, value: Any, low: int, high: int | None = None, why: str = "") -> None:
  """Raises ValueError("<key> must be an int in [low, high]<why>, got <value>") unless it
  is (high None: no upper bound)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
    rule = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    raise ValueError(f"{key} must be {rule}{why}, got {value!r}")


def require_fraction(key: str, value: Any) -> None:
  """Raises ValueError unless `value` is a number in [0, 1]."""
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 <= value <= 1):
    raise ValueError(f"{key} must be a number in [0, 1], got {value!r}")


def unknown_keys(section: str, given: Sequence[str], known: Sequence[str]) -> None:
  """Raises ValueError naming keys of `section` that the task does not have."""
  unknown = sorted(set(given) - set(known))
  if unknown:
    raise ValueError(f"{section} has no key(s) {unknown}; the keys are {sorted(known)}")
