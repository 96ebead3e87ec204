"""Byte-level and BPE tokenizers."""

import numpy as np
import pytest

from castle_jax.data.tokenizer import (
  BPETokenizer,
  ByteTokenizer,
  PretrainedTokenizer,
  load_tokenizer,
  train_bpe_tokenizer,
)

TEXT = "def héllo(x):\n    return '☃' * x  # ünïcode\n"


def test_byte_round_trip_and_specials():
  tok = ByteTokenizer()
  ids = tok.encode(TEXT)
  assert ids.dtype == np.int32 and len(ids) == len(TEXT.encode("utf-8"))
  assert tok.decode(ids) == TEXT
  with_specials = np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])
  assert tok.decode(with_specials) == TEXT
  assert tok.token_byte_lengths[with_specials].sum() == len(TEXT.encode("utf-8"))
  assert tok.decode([0xE2, 0x98]) == "\ufffd"  # a truncated UTF-8 sequence is replaced, not raised


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  corpus = [TEXT * 20, "import os\nimport sys\n" * 40, "for i in range(10):\n    print(i)\n" * 30]
  return train_bpe_tokenizer(corpus, vocab_size=320, path=str(tmp_path_factory.mktemp("bpe") / "tok.json"))


def test_bpe_round_trip_and_byte_lengths(bpe):
  text = "def héllo(y):\n    import os  # ☃\n"
  ids = bpe.encode(text)
  assert len(ids) < len(text.encode("utf-8"))  # merges happened
  assert bpe.decode(ids) == text
  assert bpe.token_byte_lengths[ids].sum() == len(text.encode("utf-8"))
  assert {bpe.bos_id, bpe.eos_id, bpe.pad_id} <= set(range(bpe.vocab_size))
  assert bpe.token_byte_lengths[[bpe.bos_id, bpe.eos_id, bpe.pad_id]].sum() == 0
  assert isinstance(load_tokenizer(bpe.path), BPETokenizer)


def test_bpe_without_specials_is_rejected(tmp_path):
  from tokenizers import Tokenizer, models

  path = str(tmp_path / "plain.json")
  Tokenizer(models.BPE()).save(path)
  with pytest.raises(ValueError, match="lacks the special tokens"):
    BPETokenizer(path)


def test_load_tokenizer_errors(tmp_path):
  assert isinstance(load_tokenizer("byte"), ByteTokenizer)
  with pytest.raises(ValueError, match="data.tokenizer"):
    load_tokenizer(str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match="vocab_size must be"):
    train_bpe_tokenizer(["x"], vocab_size=100, path=str(tmp_path / "t.json"))


def test_pretrained_tokenizer_takes_the_given_specials_and_counts_bytes_as_bpe_does(bpe):
  """A Hugging Face tokenizer.json (here a byte-level BPE) with special ids from its model's config."""
  tok = PretrainedTokenizer(bpe.path, bos_id=bpe.eos_id, eos_id=bpe.bos_id)
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (bpe.eos_id, bpe.bos_id, bpe.bos_id, bpe.vocab_size)
  np.testing.assert_array_equal(tok.token_byte_lengths, bpe.token_byte_lengths)
  assert tok.decode(tok.encode(TEXT)) == TEXT
