"""The configuration schema shared by every experiment file in `configs/`.

An experiment file defines `get_config()` that starts from `base_config()` and
changes what it needs. The returned `ConfigDict` is locked by `finalize()`: a key
that does not exist (a typo in a file or in `--config.key=value`) raises instead
of being silently added.
"""

from __future__ import annotations

import dataclasses
import difflib

import ml_collections

from castle_jax.config import ModelConfig
from castle_jax.data.task_data import default_knobs


def model_defaults() -> ml_collections.ConfigDict:
  """`config.model`: ModelConfig's fields and defaults, so the two cannot drift.

  A field whose default is None (model.attention_impl) becomes a str placeholder;
  model.attention_kwargs (and model.family_kwargs, model.rope_scaling) is a ConfigDict whose
  keys depend on model.attention (model.family, the scaling's type)
  (assign a dict to it, e.g. `c.model.attention_kwargs = dict(p=2)`, which also works
  on a locked config; ModelConfig rejects keys the attention does not know).
  """
  m = ml_collections.ConfigDict()
  for field in dataclasses.fields(ModelConfig):
    if field.name in ("attention_kwargs", "family_kwargs", "rope_scaling"):
      m[field.name] = ml_collections.ConfigDict()
    elif field.default is None:
      m[field.name] = ml_collections.config_dict.placeholder(str)
    else:
      m[field.name] = field.default
  return m


def base_config() -> ml_collections.ConfigDict:
  """Defaults for every field a run reads. Experiment files override a few."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  # Where checkpoints, metrics.jsonl and TensorBoard events go. Set by --workdir.
  c.workdir = ""

  # Every field of castle_jax.config.ModelConfig, with its defaults (documented there).
  c.model = model_defaults()

  c.data = ml_collections.ConfigDict()
  d = c.data
  d.dataset = "python_stdlib"  # any TFDS name; python_stdlib is built locally.
  d.data_dir = ml_collections.config_dict.placeholder(
    str
  )  # None: $CASTLE_JAX_DATA_DIR or ~/.cache/castle_jax/tensorflow_datasets
  d.source_dir = ml_collections.config_dict.placeholder(
    str
  )  # python_stdlib only: other .py files instead of the stdlib
  d.text_key = "text"
  d.train_split = "train"
  d.eval_split = "validation"
  d.tokenizer = "byte"  # "byte" or a path to a `tokenizers` JSON file (trained BPE)
  d.seq_len = 256
  d.batch_size = 16  # global, in sequences
  d.shuffle_seed = 0
  d.worker_count = 0  # grain worker processes (the evaluation: as many threads); 0 reads in the main process
  d.prefetch = 2  # train batches read ahead by a background thread; 0: read on the step's path
  # "lm": packed documents; "passkey": passkey-retrieval prompts with corpus haystacks,
  # generated on the fly (castle_jax/data/passkey_data.py), for fine-tuning and eval;
  # "variable_tracking", "mqar": synthetic mechanism tasks, no corpus (docs/tasks.md).
  d.task = "lm"
  d.passkey = ml_collections.ConfigDict()
  d.passkey.digits = 5  # decimal digits of the passkey
  d.passkey.loss = "answer"  # "answer": only the passkey tokens are targets; "all": every prompt token
  d.passkey.align_to = 0  # 0: no alignment; a DRT chunk size: the answer " is <passkey>" starts a chunk
  d.passkey.min_length = 0  # 0: every prompt fills seq_len; else lengths uniform in [min_length, seq_len]
  # The mechanism tasks' knobs, documented with their ranges where they are defined
  # (castle_jax/data/variable_tracking.py and mqar.py, class Knobs).
  d.variable_tracking = ml_collections.ConfigDict(default_knobs("variable_tracking"))
  d.mqar = ml_collections.ConfigDict(default_knobs("mqar"))

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # -1: fill with the devices left over
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.num_devices = -1  # -1: every device of the job; N: the first N (one process only), e.g. 1

  c.train = ml_collections.ConfigDict()
  t = c.train
  t.steps = 1000
  t.learning_rate = 6e-4
  t.warmup_steps = 100
  t.min_lr_ratio = 0.1  # cosine decays to this fraction of the peak
  t.b1 = 0.9
  t.b2 = 0.95
  t.eps = 1e-8
  t.weight_decay = 0.1
  t.grad_clip = 1.0
  t.grad_accum_steps = 1
  t.log_every = 10  # >= 1
  t.eval_every = 200  # 0: only at the last step
  t.eval_batches = 8  # 0: no evaluation at all
  t.checkpoint_every = 200  # 0: only at the last step (and on SIGINT/SIGTERM)
  t.keep_checkpoints = 3
  t.resume = True  # continue from the newest good checkpoint in workdir if there is one
  # resume=False on a workdir that holds a run is an error unless overwrite=True,
  # which moves the old run to <workdir>.old-<time> (nothing is deleted).
  t.overwrite = False
  t.resume_step = ml_collections.config_dict.placeholder(int)  # None: newest good checkpoint
  # Resuming with other steps/learning_rate/warmup_steps/min_lr_ratio than the
  # checkpoint's run changes the LR schedule mid-run: an error unless this is True.
  t.allow_schedule_change = False
  t.progress_bar = True
  # Fine-tuning: the workdir of an earlier run (same model.* and tokenizer), or a Hugging Face
  # Llama/Qwen2 model directory (its model.* and tokenizer: configs/hf_finetune.py). A fresh run
  # starts from the parameters of its newest good checkpoint, or the directory's weights
  # (optimizer state and step start fresh); once this run has checkpoints of its own, resuming
  # uses those.
  t.init_from = ml_collections.config_dict.placeholder(str)  # None or "": off
  # Several seeds of this config (docs/training.md#several-seeds): None trains one run in the
  # workdir; N >= 1 trains seeds 0..N-1, seed k in <workdir>/seed_<k>/ (a normal workdir) with
  # seed = data.shuffle_seed = k, so runs of two configs with the same seed index are paired.
  t.seeds = ml_collections.config_dict.placeholder(int)
  # "vmap": every seed in one step vmapped over a leading seed axis (small models);
  # "sequential": the seeds one after another, each with the normal loop.
  t.seeds_mode = "vmap"
  # With train.seeds=N: only these seed indices of the N (e.g. (1, 3); `=2` on a command line is
  # (2,)); None: all N. Processes started with disjoint indices (one per GPU) train into the same
  # workdir the layout of one run of N seeds, which castle_jax.eval.compare reads as one arm.
  t.seed_indices = ml_collections.config_dict.placeholder(tuple)
  return c


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Locks the config so unknown keys raise, and returns it."""
  config.lock()
  return config


# Sub-dicts whose keys are free-form (their meaning depends on another setting).
_FREE_FORM = ("model.attention_kwargs", "model.family_kwargs", "model.rope_scaling")


def validate_keys(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming every key that `base_config()` does not define.

  An experiment file that assigns a misspelled key (`c.train.stpes = 10`) would
  otherwise add it silently to an unlocked ConfigDict.
  """
  schema = base_config()
  unknown = _unknown_keys(config, schema, "")
  if unknown:
    named = []
    for path in unknown:
      section, _, key = path.rpartition(".")
      node = schema
      for part in filter(None, section.split(".")):
        node = node[part]
      known = list(node.keys())
      close = difflib.get_close_matches(key, known, n=1)
      named.append(path + (f" (did you mean {section + '.' if section else ''}{close[0]}?)" if close else ""))
    raise ValueError(
      f"Unknown config keys: {', '.join(named)}; `python -m train --config_help` lists every key "
      "(the schema is train/config.py)"
    )


def _unknown_keys(config, schema, prefix: str) -> list[str]:
  unknown = []
  for key in config.keys():
    path = f"{prefix}{key}"
    if key not in schema:
      unknown.append(path)
    elif path not in _FREE_FORM and isinstance(schema[key], ml_collections.ConfigDict):
      unknown.extend(_unknown_keys(config[key], schema[key], path + "."))
  return unknown
