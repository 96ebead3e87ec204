"""Writes tests/fixtures/hf/: tiny Hugging Face checkpoints and transformers' outputs on them.

tests/test_hf_import.py loads each checkpoint with `castle_jax.models.hf.load_hf_model`
and compares with the outputs stored here, so CI needs neither torch nor transformers.
This script needs them; run it in a separate virtual environment (CPU is enough):

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers safetensors tokenizers numpy
    /tmp/hfvenv/bin/python scripts/make_hf_fixtures.py

(the fixtures were written with transformers 5.24.0, torch 2.14.1, tokenizers 0.23.3).
Each fixture `tests/fixtures/hf/<name>/` is what `save_pretrained` writes (config.json,
safetensors weights: `llama3` in shards with model.safetensors.index.json), a small BPE
tokenizer.json, and reference.npz:

  input_ids int64 [2, 12]: fixed random ids;
  logits float32 [2, 12, vocab]: transformers' forward on them in float32;
  generated int64 [2, 12 + 8]: `generate` greedily (do_sample=False, 8 new tokens,
    min_new_tokens=8 so no end-of-sequence token stops it);
  inv_freq float32 [head_dim / 2]: the rotary embedding's inverse frequencies.

The fixtures (hidden size 32, 2 layers, 4 query heads sharing 2 key/value heads, vocab 96):

  llama3: LlamaForCausalLM with rope_theta 500000 and a "llama3" rope scaling whose
    original_max_position_embeddings (512) puts one frequency in each of its three
    bands (kept, interpolated, divided by the factor); untied head.
  llama2: LlamaForCausalLM as Llama 2 has it (rms_norm_eps 1e-5, rope_theta 10000, no
    scaling, untied head), with a SentencePiece-style tokenizer (the "\u2581" metaspace).
  qwen2: Qwen2ForCausalLM (query/key/value biases, rope_theta 1e6, tied embeddings).

Parameters are randomly initialized with a fixed seed; the norm weights and the
attention biases, which transformers initializes to ones and zeros, are perturbed so
that a wrong placement shows in the logits.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")
VOCAB = 96
PROMPT_SHAPE = (2, 12)
NEW_TOKENS = 8
TEXT = [
  "the quick brown fox jumps over the lazy dog",
  "a tiny model reads a tiny text and writes a tiny answer",
  "rotary embeddings rotate each pair of channels by an angle that grows with the position",
  "keys and values are shared by groups of query heads",
] * 4

COMMON = dict(
  vocab_size=VOCAB,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=2048,
  bos_token_id=1,
  eos_token_id=2,
  pad_token_id=0,
  torch_dtype="float32",
)


def make_tokenizer(specials: list[str], metaspace: bool) -> Tokenizer:
  """A character-level BPE of VOCAB ids trained on TEXT, specials first."""
  tokenizer = Tokenizer(models.BPE(unk_token=specials[0]))
  if metaspace:
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
  else:
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, show_progress=False)
  tokenizer.train_from_iterator(TEXT, trainer)
  assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
  return tokenizer


def perturb(model: torch.nn.Module) -> None:
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("norm.weight"):
        param.add_(0.1 * torch.randn_like(param))
      elif name.endswith(".bias"):
        param.normal_(0.0, 0.1)


def write(name: str, model_class, config, tokenizer: Tokenizer, max_shard_size: str | None = None) -> None:
  torch.manual_seed(0)
  model = model_class(config).eval()
  perturb(model)
  out = os.path.join(ROOT, name)
  shutil.rmtree(out, ignore_errors=True)
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(out, safe_serialization=True, **kwargs)
  tokenizer.save(os.path.join(out, "tokenizer.json"))
  ids = torch.from_numpy(np.random.default_rng(0).integers(3, VOCAB, PROMPT_SHAPE))
  with torch.no_grad():
    logits = model(ids).logits.float().numpy()
    generated = model.generate(
      ids,
      attention_mask=torch.ones_like(ids),
      max_new_tokens=NEW_TOKENS,
      min_new_tokens=NEW_TOKENS,
      do_sample=False,
    ).numpy()
  inv_freq = model.model.rotary_emb.inv_freq.float().numpy()
  np.savez(
    os.path.join(out, "reference.npz"), input_ids=ids.numpy(), logits=logits, generated=generated, inv_freq=inv_freq
  )
  print(f"{name}: {sorted(os.listdir(out))}")


def main() -> None:
  os.makedirs(ROOT, exist_ok=True)
  llama3_rope = dict(
    rope_type="llama3",
    rope_theta=500_000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=512,
  )
  write(
    "llama3",
    transformers.LlamaForCausalLM,
    transformers.LlamaConfig(**COMMON, rms_norm_eps=1e-5, rope_parameters=llama3_rope, tie_word_embeddings=False),
    make_tokenizer(["<|reserved|>", "<|begin_of_text|>", "<|end_of_text|>"], metaspace=False),
    max_shard_size="20KB",
  )
  write(
    "llama2",
    transformers.LlamaForCausalLM,
    transformers.LlamaConfig(
      **COMMON,
      rms_norm_eps=1e-5,
      rope_parameters=dict(rope_type="default", rope_theta=10_000.0),
      tie_word_embeddings=False,
    ),
    make_tokenizer(["<unk>", "<s>", "</s>"], metaspace=True),
  )
  write(
    "qwen2",
    transformers.Qwen2ForCausalLM,
    transformers.Qwen2Config(
      **COMMON,
      rms_norm_eps=1e-6,
      rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
      tie_word_embeddings=True,
      use_sliding_window=False,
    ),
    make_tokenizer(["<|pad|>", "<|im_start|>", "<|endoftext|>"], metaspace=False),
  )


if __name__ == "__main__":
  main()
