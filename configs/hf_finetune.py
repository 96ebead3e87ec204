"""Fine-tunes a Hugging Face Llama or Qwen2 model directory (config.json, *.safetensors,
tokenizer.json) on the corpus: the directory follows the file's name,

    python -m train --config=configs/hf_finetune.py:path/to/Llama-3.2-1B --workdir=runs/llama_ft

model.* is the directory's model (`castle_jax.models.hf.finetune_model_settings`),
data.tokenizer its tokenizer and train.init_from the directory itself: the run starts from its
weights with a fresh optimizer at step 0 (docs/hf_import.md#fine-tuning-a-hugging-face-model).
The dtypes are the base config's (bfloat16 activations, float32 parameters; on CPU pass
--config.model.dtype=float32); the schedule a short, gentle fine-tune.
"""

import os

from castle_jax.models.hf import finetune_model_settings
from train.config import base_config, finalize


def get_config(model_dir: str = ""):
  if not model_dir:
    raise ValueError(
      "no model directory: pass it after the file's name, --config=configs/hf_finetune.py:path/to/model_dir"
    )
  model_dir = os.path.abspath(model_dir)
  c = base_config()
  for key, value in finetune_model_settings(model_dir).items():
    c.model[key] = value
  c.data.tokenizer = model_dir
  c.data.seq_len = 512
  c.data.batch_size = 16
  c.train.init_from = model_dir
  c.train.steps = 1000
  c.train.learning_rate = 2e-5
  c.train.warmup_steps = 50
  c.train.weight_decay = 0.0
  return finalize(c)
