"""Passkey prompts (the GCA paper's template, App. D), shared by the passkey training
stream (`castle_jax.data.passkey_data`) and the evaluation (`castle_jax.eval.passkey`).

    <haystack text> The passkey is: <passkey>. <haystack text> ...
    What is the passkey? The passkey is <passkey>
"""

from __future__ import annotations

import dataclasses

import numpy as np

from castle_jax.data.tokenizer import Tokenizer

NEEDLE = " The passkey is: {passkey}. "
QUESTION = " What is the passkey? The passkey"
ANSWER = " is {passkey}"


@dataclasses.dataclass(frozen=True)
class PasskeyExample:
  """tokens: int32 [length], the whole prompt with the answer at the end;
  answer_start: index of the passkey's first token; answer_length: its token count;
  needle_position: index of the needle's first token; passkey: the digits."""

  tokens: np.ndarray
  answer_start: int
  answer_length: int
  needle_position: int
  passkey: str


def make_example(
  tokenizer: Tokenizer,
  haystack: np.ndarray,
  length: int,
  *,
  seed: int,
  digits: int = 5,
  depth: float | None = None,
  align_to: int | None = None,
) -> PasskeyExample:
  """One passkey prompt of exactly `length` tokens.

  Args:
    tokenizer: encodes the needle and the question (and supplies BOS).
    haystack: int [n] filler tokens (real text); repeated when shorter than needed, and
      read from a seed-dependent offset.
    length: total tokens, answer included.
    seed: chooses the passkey, the needle's depth (unless given) and the filler offset.
    digits: passkey length in decimal digits.
    depth: the needle's position as a fraction of the filler (0 = start), or None: random.
    align_to: if set, pad so that the answer part " is <passkey>" starts a new chunk of
      this many tokens.

  Raises:
    ValueError: `length` too short for the needle, the question and the answer.
  """
  rng = np.random.default_rng(seed)
  passkey = "".join(str(d) for d in rng.integers(0, 10, digits))
  needle = tokenizer.encode(NEEDLE.format(passkey=passkey))
  question = tokenizer.encode(QUESTION)
  answer_prefix = tokenizer.encode(ANSWER.format(passkey=""))
  answer = tokenizer.encode(passkey)
  fixed = 1 + len(needle) + len(question) + len(answer_prefix) + len(answer)
  answer_part_start = length - len(answer_prefix) - len(answer)
  # Aligned: less filler, and padding after the answer, so " is <passkey>" starts a chunk.
  pad = answer_part_start % align_to if align_to else 0
  filler_length = length - fixed - pad
  if filler_length < 1:
    raise ValueError(
      f"length {length} is too short for a passkey prompt ({fixed} tokens without haystack"
      + (f", aligned to chunks of {align_to}" if align_to else "")
      + ")"
    )
  haystack = np.asarray(haystack, np.int32)
  if haystack.size == 0:
    raise ValueError("haystack is empty: pass real text tokens")
  offset = int(rng.integers(0, haystack.size))
  filler = np.resize(np.roll(haystack, -offset), filler_length)
  cut = int(round((rng.random() if depth is None else depth) * filler_length))
  tokens = np.concatenate(
    [
      [tokenizer.bos_id],
      filler[:cut],
      needle,
      filler[cut:],
      question,
      answer_prefix,
      answer,
      np.full(pad, tokenizer.pad_id),
    ]
  ).astype(np.int32)
  answer_start = length - pad - len(answer)
  return PasskeyExample(tokens, answer_start, len(answer), 1 + cut, passkey)
