"""Sample text from a trained checkpoint.

    python -m train.generate --workdir=runs/tiny --prompt="def main(" --max_new_tokens=200

Reads `<workdir>/config.json` (written by training) to rebuild the model and
tokenizer, restores the parameters of the latest (or `--step`) checkpoint, and
prints the prompt followed by the generated continuation. `--workdir` may also be a
Hugging Face model directory (Llama or Qwen2: config.json, *.safetensors,
tokenizer.json; `castle_jax.models.hf`), read in float32, without `--step`:

    python -m train.generate --workdir=tests/fixtures/hf/llama3 --prompt="the quick" \
        --max_new_tokens=8 --temperature=0

With `--draft_workdir` (a LongSpec draft trained for this target), the continuation is
decoded speculatively (`castle_jax.inference.speculative_generate`; the same output as
the target alone at temperature 0, the same distribution otherwise) and the mean tokens
per target forward (tau) and the decoding speed are printed:

    python -m train.generate --workdir=runs/longspec_target_tiny \
        --draft_workdir=runs/longspec_draft_tiny_long --temperature=0 --tree=4,16,16,16,16

With `--tensor=N` the model (and a draft) is tensor-parallel over N devices: each weight
is read straight into its shards (heads, MLP width and vocabulary split N ways, as
training's mesh.tensor splits them), so a model larger than one device's memory decodes:

    python -m train.generate --workdir=/models/Meta-Llama-3-8B --tensor=8 --prompt="def main(" --temperature=0
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

from castle_jax.checkpoints import CheckpointError
from castle_jax.command_line import UsageError, run_absl
from castle_jax.inference import generate
from castle_jax.inference.speculative import DEFAULT_TREE, speculative_generate
from castle_jax.sharding import on_mesh
from castle_jax.workdir import TrainedModel, load_draft, load_trained_model, tensor_parallel_mesh

_WORKDIR = flags.DEFINE_string(
  "workdir",
  None,
  "Training workdir (holds config.json and checkpoints/), or a Hugging Face model directory (config.json, "
  "*.safetensors, tokenizer.json).",
)
_STEP = flags.DEFINE_integer(
  "step", None, "Checkpoint step (default: latest; not for a Hugging Face directory).", lower_bound=0
)
_PROMPT = flags.DEFINE_string("prompt", "def ", "Text to continue.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "0 for greedy decoding.", lower_bound=0)
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: all).", lower_bound=0)
_TOP_P = flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass in (0, 1] (1: off).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_DRAFT = flags.DEFINE_string("draft_workdir", None, "A LongSpec draft's workdir: decode speculatively.")
_TREE = flags.DEFINE_list("tree", [str(w) for w in DEFAULT_TREE], "Draft nodes per tree level (a chain: 1,1,1,1).")
_TENSOR = flags.DEFINE_integer(
  "tensor",
  1,
  "Tensor-parallel degree: shard the model's heads, MLP width and vocabulary over this many devices, loading "
  "the weights straight into their shards (1: one device).",
)
_WARMUP = flags.DEFINE_bool("warmup", False, "Speculative: run once before timing, so tokens/s excludes compilation.")
flags.register_validator("top_p", lambda p: 0 < p <= 1, "must be in (0, 1] (1 turns nucleus sampling off)")
flags.register_validator(
  "tree",
  lambda widths: bool(widths) and all(w.strip().isdigit() and int(w) >= 1 for w in widths),
  "must list positive integers, the draft nodes per tree level, e.g. --tree=4,16,16 (a chain: --tree=1,1,1,1)",
)

# Errors whose message says what to change (a workdir without checkpoints, a draft for
# another target, ...): one line.
_ERRORS = (UsageError, FileNotFoundError, ValueError, CheckpointError)


def continue_prompt(
  target: TrainedModel,
  prompt: np.ndarray,
  *,
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  seed: int = 0,
  draft: TrainedModel | None = None,
  tree: tuple[int, ...] = DEFAULT_TREE,
  warmup: bool = False,
) -> tuple[np.ndarray, str | None]:
  """What the command decodes: `prompt` (int32 [n], the BOS already in it) and its
  continuation, int32 [n + max_new_tokens], by `target` alone or, with a LongSpec `draft`
  (`load_draft`), speculatively; and the speculative run's line of tau and speed (None
  without a draft). warmup: decode once before timing, so the speed excludes compilation."""
  sampling = dict(rng=jax.random.key(seed), temperature=temperature, top_k=top_k, top_p=top_p)
  prompt = jnp.asarray(prompt, jnp.int32)[None]
  if draft is None:
    tokens = generate(target.model, target.params, prompt, max_new_tokens=max_new_tokens, **sampling)
    return np.asarray(tokens[0]), None
  run = lambda: speculative_generate(
    target.model, target.params, draft.model, draft.params, prompt, max_new_tokens=max_new_tokens, tree=tree, **sampling
  )
  if warmup:
    jax.block_until_ready(run().tokens)
  start = time.perf_counter()
  result = run()
  tokens = jax.block_until_ready(result.tokens)
  seconds = time.perf_counter() - start
  line = (
    f"# speculative: draft step {draft.step}, tree {list(tree)}: tau {result.mean_accepted:.2f} tokens per "
    f"target forward over {result.rounds} rounds, {max_new_tokens / seconds:.1f} tokens/s"
    + ("" if warmup else " (including compilation; --warmup to exclude it)")
  )
  return np.asarray(tokens[0]), line


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if not _WORKDIR.value:
    raise UsageError(
      "--workdir is required: pass the workdir of a run of `python -m train` (e.g. --workdir=runs/tiny) or a "
      "Hugging Face model directory"
    )
  mesh = tensor_parallel_mesh(_TENSOR.value)
  target = load_trained_model(_WORKDIR.value, _STEP.value, mesh=mesh)
  draft = load_draft(_DRAFT.value, target, mesh=mesh) if _DRAFT.value else None
  tokenizer = target.tokenizer
  prompt = np.concatenate([[tokenizer.bos_id], tokenizer.encode(_PROMPT.value)]).astype(np.int32)
  with on_mesh(mesh):
    tokens, speculative = continue_prompt(
      target,
      prompt,
      max_new_tokens=_MAX_NEW.value,
      temperature=_TEMPERATURE.value,
      top_k=_TOP_K.value,
      top_p=_TOP_P.value,
      seed=_SEED.value,
      draft=draft,
      tree=tuple(int(w) for w in _TREE.value),
      warmup=_WARMUP.value,
    )
  if speculative is not None:
    print(speculative)
  print(f"# step {target.step}, temperature {_TEMPERATURE.value}")
  print(tokenizer.decode(tokens[1:]))


if __name__ == "__main__":
  run_absl(main, errors=_ERRORS)
