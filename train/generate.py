"""Sample text from a trained checkpoint.

    python -m train.generate --workdir=runs/tiny --prompt="def main(" --max_new_tokens=200

Reads `<workdir>/config.json` (written by training) to rebuild the model and
tokenizer, restores the parameters of the latest (or `--step`) checkpoint, and
prints the prompt followed by the generated continuation.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from castle_jax.checkpoints import CheckpointError
from castle_jax.inference import generate
from castle_jax.workdir import load_trained_model

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir (holds config.json and checkpoints/).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: latest).")
_PROMPT = flags.DEFINE_string("prompt", "def ", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "0 for greedy decoding.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass (1: off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  try:
    model, params, tokenizer, step = load_trained_model(_WORKDIR.value, _STEP.value)
  except (FileNotFoundError, ValueError, CheckpointError) as e:
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    sys.exit(1)
  prompt = np.concatenate([[tokenizer.bos_id], tokenizer.encode(_PROMPT.value)]).astype(np.int32)
  tokens = generate(model, params, jnp.asarray(prompt)[None], max_new_tokens=_MAX_NEW.value,
                    rng=jax.random.key(_SEED.value), temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                    top_p=_TOP_P.value)
  print(f"# step {step}, temperature {_TEMPERATURE.value}")
  print(tokenizer.decode(np.asarray(tokens[0, 1:])))


if __name__ == "__main__":
  app.run(main)
