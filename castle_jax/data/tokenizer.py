"""Tokenizers: a byte-level default and trained BPE (the `tokenizers` package)."""

from __future__ import annotations

import abc
import json
import os
from typing import Iterable

import numpy as np

SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
# A Hugging Face model directory's tokenizer and the config.json holding its special ids.
HF_TOKENIZER_NAME = "tokenizer.json"
HF_CONFIG_NAME = "config.json"


class Tokenizer(abc.ABC):
  """Text <-> int32 ids, with BOS/EOS/PAD specials.

  Attributes:
    vocab_size: number of ids (the model's vocab_size must be at least this).
    bos_id, eos_id, pad_id: ids of the special tokens.
    token_byte_lengths: int32 [vocab_size], the UTF-8 bytes each id stands for
      (0 for specials); bits per byte = total nats / ln 2 / total bytes.
  """

  vocab_size: int
  bos_id: int
  eos_id: int
  pad_id: int
  token_byte_lengths: np.ndarray

  @abc.abstractmethod
  def encode(self, text: str) -> np.ndarray:
    """int32 [n] ids of `text`, without special tokens."""

  @abc.abstractmethod
  def decode(self, ids) -> str:
    """Text of `ids`; special tokens are dropped and invalid UTF-8 is replaced."""


class ByteTokenizer(Tokenizer):
  """Ids 0..255 are the UTF-8 bytes; 256, 257, 258 are BOS, EOS, PAD."""

  def __init__(self):
    self.bos_id, self.eos_id, self.pad_id = 256, 257, 258
    self.vocab_size = 259
    self.token_byte_lengths = np.array([1] * 256 + [0, 0, 0], np.int32)

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


def _import_tokenizers():
  try:
    import tokenizers
  except ImportError as e:
    raise ImportError("BPE tokenizers need the `tokenizers` package: pip install 'castle_jax[bpe]'") from e
  return tokenizers


class BPETokenizer(Tokenizer):
  """A byte-level BPE from a `tokenizers` JSON file defining <bos>, <eos> and <pad>."""

  def __init__(self, path: str):
    tokenizers = _import_tokenizers()
    self.path = path
    self._tokenizer = tokenizers.Tokenizer.from_file(path)
    ids = {t: self._tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
      raise ValueError(
        f"Tokenizer file {path} lacks the special tokens {missing}; train it with "
        "castle_jax.data.tokenizer.train_bpe_tokenizer or add them"
      )
    self.bos_id, self.eos_id, self.pad_id = (ids[t] for t in SPECIAL_TOKENS)
    self.vocab_size = self._tokenizer.get_vocab_size()
    specials = set(ids.values())
    self.token_byte_lengths = np.array(
      [0 if i in specials else len(self._token_bytes(i)) for i in range(self.vocab_size)], np.int32
    )

  def _token_bytes(self, token_id: int) -> bytes:
    token = self._tokenizer.id_to_token(token_id) or ""
    return bytes(_BYTE_OF_CHAR[ch] for ch in token if ch in _BYTE_OF_CHAR)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)


class PretrainedTokenizer(Tokenizer):
  """A Hugging Face `tokenizer.json` (byte-level BPE as in Llama 3 and Qwen2, or
  SentencePiece-style with byte fallback as in Llama 2) whose special ids are given by
  the model's config rather than named <bos>/<eos>/<pad>.

  token_byte_lengths: 0 for the file's special added tokens, 1 for a byte-fallback
  token <0xNN>, the bytes a byte-level token stands for, else the UTF-8 length of the
  token with SentencePiece's "▁" read as a space.
  """

  def __init__(self, path: str, bos_id: int, eos_id: int, pad_id: int | None = None):
    tokenizers = _import_tokenizers()
    self.path = path
    self._tokenizer = tokenizers.Tokenizer.from_file(path)
    self.vocab_size = self._tokenizer.get_vocab_size()
    self.bos_id, self.eos_id = int(bos_id), int(eos_id)
    self.pad_id = self.eos_id if pad_id is None else int(pad_id)
    specials = {token.content for token in self._tokenizer.get_added_tokens_decoder().values() if token.special}
    byte_level = _decoder_is_byte_level(self._tokenizer.decoder)
    lengths = []
    for i in range(self.vocab_size):
      token = self._tokenizer.id_to_token(i)
      lengths.append(0 if token is None or token in specials else _token_byte_length(token, byte_level))
    self.token_byte_lengths = np.array(lengths, np.int32)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)


def _decoder_is_byte_level(decoder) -> bool:
  if decoder is None:
    return False
  state = json.loads(decoder.__getstate__())
  kinds = [state.get("type")] + [d.get("type") for d in state.get("decoders", [])]
  return "ByteLevel" in kinds


def _token_byte_length(token: str, byte_level: bool) -> int:
  if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
    return 1  # a byte-fallback token
  if byte_level and all(ch in _BYTE_OF_CHAR for ch in token):
    return len(token)
  return len(token.replace("▁", " ").encode("utf-8"))


def _gpt2_byte_alphabet() -> dict[str, int]:
  """Byte-level BPE writes each byte as a printable character (the GPT-2 byte
  encoder): printable Latin-1 bytes stand for themselves, the other bytes map to
  chr(256), chr(257), ... in byte order. Returns character -> byte."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[chr(b)] = b
    else:
      chars[chr(256 + extra)] = b
      extra += 1
  return chars


_BYTE_OF_CHAR = _gpt2_byte_alphabet()


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: str) -> BPETokenizer:
  """Trains a byte-level BPE with the three special tokens and saves it to `path`."""
  tokenizers = _import_tokenizers()
  from tokenizers import decoders, models, pre_tokenizers, trainers

  if vocab_size < 256 + len(SPECIAL_TOKENS):
    raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size}")
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=list(SPECIAL_TOKENS),
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tokenizer.train_from_iterator(texts, trainer)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tokenizer.save(path)
  return BPETokenizer(path)


def load_hf_tokenizer(directory: str, config: dict | None = None) -> PretrainedTokenizer:
  """A Hugging Face model directory's tokenizer: `directory`/tokenizer.json with the special
  ids of `config` (its config.json as a dict; None: read it). A list of eos ids gives the
  first; no bos id gives eos. ValueError when a file or the eos id is missing."""
  tokenizer_path = os.path.join(directory, HF_TOKENIZER_NAME)
  if not os.path.isfile(tokenizer_path):
    raise ValueError(f"{tokenizer_path} not found: a Hugging Face model directory needs {HF_TOKENIZER_NAME}")
  config_path = os.path.join(directory, HF_CONFIG_NAME)
  if config is None:
    if not os.path.isfile(config_path):
      raise ValueError(f"{config_path} not found: a Hugging Face tokenizer takes its special ids from it")
    with open(config_path) as f:
      config = json.load(f)
  first = lambda value: value[0] if isinstance(value, list) else value
  eos = first(config.get("eos_token_id"))
  bos = first(config.get("bos_token_id"))
  if eos is None:
    raise ValueError(f"{config_path} has no eos_token_id")
  return PretrainedTokenizer(tokenizer_path, eos if bos is None else bos, eos, first(config.get("pad_token_id")))


def load_tokenizer(spec: str) -> Tokenizer:
  """config data.tokenizer: "byte" for the byte tokenizer, the path of a BPE JSON file, or a
  Hugging Face model directory (`load_hf_tokenizer`: its tokenizer.json, whose special ids
  are in its config.json)."""
  if spec == "byte":
    return ByteTokenizer()
  if os.path.isdir(spec):
    return load_hf_tokenizer(spec)
  if not os.path.isfile(spec):
    raise ValueError(
      f"data.tokenizer={spec!r} is neither 'byte', an existing tokenizer JSON file nor a Hugging Face model directory"
    )
  return BPETokenizer(spec)
