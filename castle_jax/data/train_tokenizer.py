"""Train a byte-level BPE tokenizer on a dataset's training split.

    python -m castle_jax.data.train_tokenizer --vocab_size=8192 --output=runs/bpe8k.json \
        [--dataset=python_stdlib --data_dir=... --source_dir=... --text_key=text --max_documents=N]

Then train with `--config.data.tokenizer=runs/bpe8k.json --config.model.vocab_size=8192`
(model.vocab_size must be at least the tokenizer's vocabulary).
"""

from __future__ import annotations

import os

from absl import flags, logging

from castle_jax.command_line import UsageError, run_absl
from castle_jax.data.pipeline import get_data_source
from castle_jax.data.tokenizer import train_bpe_tokenizer

_VOCAB = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size, special tokens included.", lower_bound=1)
_OUTPUT = flags.DEFINE_string("output", None, "Where to write the tokenizer JSON (a new file).")
_DATASET = flags.DEFINE_string("dataset", "python_stdlib", "TFDS dataset name.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "TFDS data dir.")
_SOURCE_DIR = flags.DEFINE_string("source_dir", None, "For python_stdlib: another directory of .py files.")
_SPLIT = flags.DEFINE_string("split", "train", "Split to train on.")
_TEXT_KEY = flags.DEFINE_string("text_key", "text", "Feature holding the text.")
_MAX_DOCS = flags.DEFINE_integer("max_documents", 0, "Use at most this many documents (0: all).", lower_bound=0)
flags.register_validator(
  "output", lambda path: path is None or not os.path.lexists(path), "exists: pass a new file name"
)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  if not _OUTPUT.value:
    raise UsageError("--output is required: where to write the tokenizer, e.g. --output=runs/bpe8k.json")
  source = get_data_source(_DATASET.value, _SPLIT.value, _DATA_DIR.value, _SOURCE_DIR.value)
  count = len(source) if not _MAX_DOCS.value else min(len(source), _MAX_DOCS.value)

  def texts():
    for i in range(count):
      text = source[i][_TEXT_KEY.value]
      yield text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text

  tokenizer = train_bpe_tokenizer(texts(), _VOCAB.value, _OUTPUT.value)
  print(f"Trained a {tokenizer.vocab_size}-token BPE on {count} documents -> {_OUTPUT.value}")


if __name__ == "__main__":
  run_absl(main, errors=(UsageError, ValueError, FileNotFoundError))
