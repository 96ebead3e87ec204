"""A grain stream of passkey-retrieval examples, generated on the fly (data.task="passkey").

Example `i` of a split is a pure function of (data.shuffle_seed, split name, i): its
haystack is real text (consecutive documents of the configured TFDS split, from a
document picked by the example's seed) and its prompt is
`castle_jax.data.passkey_prompts.make_example` (needle at a random depth, random digits). The
stream is a grain MapDataset over example indices, so the iterator's state is just
the next index and a checkpoint resumes exactly where it stopped; train and eval
splits use different seeds (and different documents).

Each example is a window of `length + 1` tokens, `length` drawn from
[data.passkey.min_length, data.seq_len] (all equal to seq_len by default), right-padded
with the pad id to seq_len + 1, then split into the usual shifted pair. With
data.passkey.loss="answer" only the targets that are passkey tokens are kept; every
other target is the pad id, which the loss ignores.
"""

from __future__ import annotations

import zlib
from typing import Any

import grain
import numpy as np

from castle_jax.data.tokenizer import Tokenizer
from castle_jax.data.passkey_prompts import ANSWER, NEEDLE, QUESTION, make_example

LOSSES = ("answer", "all")
_INDICES = 2**62  # "forever": a MapDataset needs a length


def check_passkey_config(data_config, tokenizer: Tokenizer) -> None:
  """Raises ValueError naming the data.passkey key (or data.seq_len) that cannot work."""
  p = data_config.passkey
  if p.loss not in LOSSES:
    raise ValueError(f"data.passkey.loss must be one of {LOSSES}, got {p.loss!r}")
  if isinstance(p.digits, bool) or not isinstance(p.digits, int) or p.digits < 1:
    raise ValueError(f"data.passkey.digits must be an int >= 1, got {p.digits!r}")
  if p.align_to is not None and (isinstance(p.align_to, bool) or not isinstance(p.align_to, int) or p.align_to < 0):
    raise ValueError(f"data.passkey.align_to must be 0 (no alignment) or a chunk size >= 1, got {p.align_to!r}")
  need = minimum_length(tokenizer, p.digits, p.align_to)
  if data_config.seq_len + 1 < need:
    raise ValueError(
      f"data.seq_len ({data_config.seq_len}) is too short for a passkey prompt of data.passkey.digits="
      f"{p.digits}"
      + (f" aligned to data.passkey.align_to={p.align_to}" if p.align_to else "")
      + f": it needs seq_len >= {need - 1}; raise data.seq_len"
    )
  if p.min_length and not need - 1 <= p.min_length <= data_config.seq_len:
    raise ValueError(
      f"data.passkey.min_length ({p.min_length}) must be 0 (every example fills data.seq_len) or in "
      f"[{need - 1} (the shortest prompt), {data_config.seq_len} (data.seq_len)]"
    )


def minimum_length(tokenizer: Tokenizer, digits: int, align_to: int | None) -> int:
  """Tokens (answer included) of the shortest prompt: BOS, needle, question, answer,
  one haystack token, and up to align_to - 1 alignment pads."""
  passkey = "0" * digits
  fixed = 1 + sum(
    len(tokenizer.encode(text))
    for text in (NEEDLE.format(passkey=passkey), QUESTION, ANSWER.format(passkey=""), passkey)
  )
  return fixed + 1 + (align_to - 1 if align_to else 0)


def split_salt(split: str) -> int:
  """A stable number per split name, so train and eval examples differ."""
  return zlib.crc32(split.encode())


class PasskeyExamples:
  """index -> {"inputs": int32 [seq_len], "targets": int32 [seq_len]} (picklable, for grain workers)."""

  def __init__(self, source, tokenizer: Tokenizer, data_config, split: str):
    p = data_config.passkey
    self.source, self.tokenizer, self.text_key = source, tokenizer, data_config.text_key
    self.seq_len, self.seed, self.salt = data_config.seq_len, data_config.shuffle_seed, split_salt(split)
    self.digits, self.loss, self.align_to = p.digits, p.loss, p.align_to or None
    self.min_length = p.min_length or data_config.seq_len

  def haystack(self, rng: np.random.Generator, length: int) -> np.ndarray:
    """int32 [>= length] tokens of consecutive documents from a random one on, each
    followed by EOS, BOS (as the LM stream packs them)."""
    index, pieces, count = int(rng.integers(len(self.source))), [], 0
    while count < length:
      text = self.source[index % len(self.source)][self.text_key]
      if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
      # A token spans at least one character: 8x the characters bounds the work and
      # almost always gives `length` tokens; a short document is followed by the next.
      pieces.append(
        np.concatenate(
          [self.tokenizer.encode(text[: 8 * length])[:length], [self.tokenizer.eos_id, self.tokenizer.bos_id]]
        ).astype(np.int32)
      )
      count += len(pieces[-1])
      index += 1
    return np.concatenate(pieces)

  def __call__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([self.seed, self.salt, int(index)])
    length = int(rng.integers(self.min_length, self.seq_len + 1)) + 1
    example = make_example(
      self.tokenizer,
      self.haystack(rng, length),
      length,
      seed=int(rng.integers(2**62)),
      digits=self.digits,
      align_to=self.align_to,
    )
    window = np.full(self.seq_len + 1, self.tokenizer.pad_id, np.int32)
    window[:length] = example.tokens
    targets = window[1:].copy()
    if self.loss == "answer":
      keep = np.zeros_like(targets, dtype=bool)
      keep[example.answer_start - 1 : example.answer_start - 1 + example.answer_length] = True
      targets[~keep] = self.tokenizer.pad_id
    return {"inputs": window[:-1], "targets": targets}


def make_passkey_dataset(
  data_config, tokenizer: Tokenizer, source: Any, *, split: str, process_index: int, process_count: int
) -> grain.MapDataset:
  """Batches of passkey examples for this process (see the module docstring).

  Args:
    data_config: `config.data` (seq_len, batch_size (global), shuffle_seed, text_key,
      passkey.{digits, loss, align_to, min_length}).
    tokenizer: encodes haystack, needle and question.
    source: random-access documents of the split (the haystack).
    split: its name; salts the seeds so that splits get different examples.
    process_index, process_count: this process reads examples process_index::process_count.

  Returns:
    A MapDataset of {"inputs": int32 [batch_size // process_count, seq_len],
    "targets": int32 [batch_size // process_count, seq_len]}.
  """
  check_passkey_config(data_config, tokenizer)
  examples = PasskeyExamples(source, tokenizer, data_config, split)
  ds = grain.MapDataset.range(_INDICES)[process_index::process_count].map(examples)
  return ds.batch(data_config.batch_size // process_count, drop_remainder=True)
