"""Reading a trained workdir: its config, tokenizer and the parameters of a checkpoint.

A workdir written by `python -m train` holds `config.json` (the run's whole config;
data.tokenizer relative to the workdir), `tokenizer.json` for a BPE run, and
`checkpoints/<step>/` (Orbax steps verified by a checksum manifest, see
`castle_jax.checkpoints`). Evaluation (`castle_jax.eval`), sampling and fine-tuning
from another run (`train.init_from`) read it through this module; only the trainer
writes it.

A Hugging Face model directory (`castle_jax.models.hf`: a config.json with a `model_type`,
safetensors weights, tokenizer.json) is read wherever a workdir is: as a trained model of
step `HF_STEP`, as a LongSpec draft's frozen target (`with_hf_frozen_source`,
`load_frozen_params`), and as the parameters a run starts from (`train.init_from`,
`restore_source_params`).

    model, params, tokenizer, step = load_trained_model("runs/tiny")
    model, params, tokenizer, step = load_trained_model("tests/fixtures/hf/llama3")

On several devices the parameters go straight into their shards on a tensor-parallel
mesh (`tensor_parallel_mesh`; the commands' --tensor=N), never whole on one device:

    mesh = tensor_parallel_mesh(2)
    model, params, tokenizer, step = load_trained_model("runs/tiny", mesh=mesh)
    with on_mesh(mesh):  # castle_jax.sharding
      tokens = generate(model, params, prompt, max_new_tokens=8)
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from castle_jax.checkpoints import Checkpointer
from castle_jax.data.tokenizer import Tokenizer, load_tokenizer
from castle_jax.models import ModelConfig, build_model, family_of, hf, longspec_draft
from castle_jax.models.registry import abstract_params
from castle_jax.sharding import check_params_divisible, mesh_of

CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
CHECKPOINTS_DIR = "checkpoints"
# Which frozen parameters (a LongSpec draft's target) a run trained against.
FROZEN_NAME = "frozen_params.json"
# A run of several seeds (`train.seeds`): this record ({"seeds": N, "seeds_mode": ...}) in its
# workdir, and seed k as a normal workdir in `seed_workdir(workdir, k)`.
SEEDS_NAME = "seeds.json"
# What a --workdir (or a frozen source's directory) may be, for messages.
EXPECTED = (
  "a training workdir (written by `python -m train`: config.json, checkpoints/) or a Hugging Face model "
  "directory (config.json with a model_type, *.safetensors weights, tokenizer.json)"
)
# The step a Hugging Face model directory's weights are reported as: it has no checkpoints.
HF_STEP = 0


class TrainedModel(NamedTuple):
  """What `load_trained_model` returns (a tuple: `model, params, tokenizer, step = ...`)."""

  model: nn.Module
  params: Any
  tokenizer: Tokenizer
  step: int


def saved_config(workdir: str) -> dict[str, Any] | None:
  """The workdir's config.json as a dict, or None when there is none."""
  path = os.path.join(workdir, CONFIG_NAME)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def seed_workdir(workdir: str, index: int) -> str:
  """Where seed `index` of a run of several seeds in `workdir` lives."""
  return os.path.join(workdir, f"seed_{index}")


def seeds_record(workdir: str) -> dict[str, Any] | None:
  """The record of a run of several seeds in `workdir` ({"seeds": N, "seeds_mode": ...}), or
  None when `workdir` holds no such run."""
  path = os.path.join(workdir, SEEDS_NAME)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def read_config(workdir: str, *, what: str = "--workdir") -> ml_collections.ConfigDict:
  """The config a workdir was trained with, or for a Hugging Face model directory what a
  run's config would say of it (`hf.run_config`: its model, its tokenizer, default data).

  Raises FileNotFoundError naming `what` (the flag or key that gave the directory) when
  it has no config.json, ValueError when its config.json is neither a run's nor a
  Hugging Face model's (or names an unsupported model)."""
  path = os.path.abspath(workdir)
  if hf.is_hf_model_dir(path):
    return ml_collections.ConfigDict(hf.run_config(path))
  config = saved_config(path)
  if config is None:
    seeds = seeds_record(path)
    if seeds is not None:
      raise FileNotFoundError(
        f"{what}={workdir} holds a run of {seeds.get('seeds')} seeds, not one run: pass one seed's workdir, "
        f"e.g. {what}={seed_workdir(workdir, 0)}"
      )
    raise FileNotFoundError(f"{os.path.join(path, CONFIG_NAME)} not found: {what} must be {EXPECTED}")
  if not isinstance(config, dict) or "model" not in config:
    raise ValueError(
      f"{os.path.join(path, CONFIG_NAME)} has neither a training run's model section nor a Hugging Face "
      f"model_type: {what} must be {EXPECTED}"
    )
  return ml_collections.ConfigDict(config)


def resolve_tokenizer_path(workdir: str, tokenizer: str) -> str:
  """data.tokenizer from a saved config.json: relative paths are relative to the
  workdir (older workdirs stored them relative to where training ran)."""
  if tokenizer == "byte" or os.path.isabs(tokenizer):
    return tokenizer
  inside = os.path.join(workdir, tokenizer)
  return inside if os.path.exists(inside) else tokenizer


def restore_params(
  workdir: str, abstract: Any, *, step: int | None = None, log=None, what: str = "--workdir"
) -> tuple[Any, int]:
  """(params, step) of a workdir's checkpoint, restored into the shardings of
  `abstract` (a tree of ShapeDtypeStructs; the optimizer state is not read).

  step None: the newest step that verifies against its manifest and reads (a
  damaged newer one is reported and skipped, nothing is moved or deleted).

  Raises:
    FileNotFoundError: the workdir has no checkpoints.
    ValueError: `step` has no checkpoint (the message lists the available ones).
    CheckpointError: the step (or every step) is damaged.
  """
  checkpointer = Checkpointer(os.path.join(os.path.abspath(workdir), CHECKPOINTS_DIR), read_only=True)
  try:
    steps = checkpointer.all_steps()
    if not steps:
      raise FileNotFoundError(f"No checkpoints in {checkpointer.directory} ({what})")
    if step is not None and step not in steps:
      raise ValueError(f"No checkpoint for step {step} in {checkpointer.directory}; available: {steps}")
    return checkpointer.restore_newest_params(abstract, step=step, log=log)
  finally:
    checkpointer.close()


def restore_source_params(
  source: str,
  model_config: ModelConfig,
  abstract: Any,
  *,
  step: int | None = None,
  log=None,
  what: str = "--workdir",
  step_setting: str = "--step",
) -> tuple[Any, int]:
  """(params, step) of `source`, restored into the shardings of `abstract` (the parameters of
  `model_config` as ShapeDtypeStructs): a training workdir's checkpoint (`restore_params`;
  `step` None: the newest good one), or a Hugging Face model directory's weights
  (`hf.load_hf_params`, step `HF_STEP`; a `step` is refused, naming `step_setting`).

  `what` names the setting that gave `source`, for messages."""
  if hf.is_hf_model_dir(source):
    _refuse_hf_step(step_setting, step, f"{what}={source}")
    return hf.load_hf_params(source, model_config, abstract=abstract), HF_STEP
  return restore_params(source, abstract, step=step, log=log, what=what)


def _refuse_hf_step(setting: str, step: int | None, where: str) -> None:
  """ValueError when a step is asked of a Hugging Face model directory (`where`)."""
  if step is not None:
    raise ValueError(
      f"{setting}={step}: {where} is a Hugging Face model directory, whose weights have no checkpoint "
      f"steps; leave {setting} out"
    )


def load_trained_model(
  workdir: str, step: int | None = None, *, log=None, mesh: jax.sharding.Mesh | None = None, flag: str = "--tensor"
) -> TrainedModel:
  """(model, params, tokenizer, step) from a training workdir or a Hugging Face model directory.

  A workdir: reads `<workdir>/config.json` and restores only the parameters (not the
  optimizer state) of the newest good checkpoint, or of `step`, after checking it
  against its checksum manifest. The tokenizer is the workdir's. `log` receives warnings
  (default: stderr).

  A Hugging Face model directory (`hf.is_hf_model_dir`): `hf.load_hf_model` in float32,
  step `HF_STEP`; `step` must be None (its weights have no checkpoint steps).

  mesh: None: the parameters go to one device. A mesh (`tensor_parallel_mesh`): each
  parameter is read into its shards on the mesh, by its logical axis names as training
  places it (`abstract_params`), never whole on one device; the computations that use them
  run under `castle_jax.sharding.on_mesh(mesh)`. A model whose heads or widths do not
  divide over the mesh is refused first (ValueError naming `flag`).
  """
  workdir = os.path.abspath(workdir)
  if hf.is_hf_model_dir(workdir):
    _refuse_hf_step("--step", step, workdir)
    abstract = None
    if mesh is not None:
      model_config = hf.hf_model_config(workdir)
      abstract = abstract_params(build_model(model_config), 8, mesh=mesh)
      check_mesh_fits(model_config, abstract, mesh, flag)
    return TrainedModel(*hf.load_hf_model(workdir, mesh=mesh, abstract=abstract), HF_STEP)
  config = read_config(workdir)
  model = build_model(ModelConfig.from_mapping(config.model))
  abstract = abstract_params(model, config.data.seq_len, mesh=mesh)
  if mesh is not None:
    check_mesh_fits(model.config, abstract, mesh, flag)
  params, step = restore_params(workdir, abstract, step=step, log=log)
  return TrainedModel(model, params, load_workdir_tokenizer(workdir, config), step)


def tensor_parallel_mesh(tensor: int, *, flag: str = "--tensor") -> jax.sharding.Mesh | None:
  """The mesh that `tensor`-way tensor parallelism (heads, MLP width and vocabulary split over
  the "tensor" axis, as training's mesh.tensor splits them) runs on: the first `tensor`
  devices, or None (one device) for 1.

  Raises ValueError naming `flag` when `tensor` is not a positive divisor of the number of
  devices."""
  count = jax.device_count()
  if tensor < 1 or count % tensor:
    choices = ", ".join(str(n) for n in range(1, count + 1) if count % n == 0)
    raise ValueError(
      f"{flag}={tensor} must divide the {count} devices ({jax.default_backend()}): pass one of {choices}"
    )
  if tensor == 1:
    return None
  return mesh_of((1, 1, tensor), jax.devices()[:tensor])


def check_mesh_fits(config: ModelConfig, abstract: Any, mesh: jax.sharding.Mesh, flag: str = "--tensor") -> None:
  """ValueError naming `flag` unless the attention heads, key/value heads and every parameter
  (`abstract`, sharded over `mesh`) divide over the mesh's tensor axis."""
  ways = mesh.shape["tensor"]
  if config.n_heads % ways or config.kv_heads % ways:
    fits = [n for n in range(1, jax.device_count() + 1) if jax.device_count() % n == 0]
    fits = [n for n in fits if config.n_heads % n == 0 and config.kv_heads % n == 0]
    raise ValueError(
      f"{flag}={ways} does not divide the model's {config.n_heads} attention heads and {config.kv_heads} "
      f"key/value heads: pass {' or '.join(f'{flag}={n}' for n in fits)}"
    )
  check_params_divisible(abstract, f"Pass a {flag} that divides it.", what=f"{flag}={ways}: parameter")


def load_workdir_tokenizer(workdir: str, config: ml_collections.ConfigDict | None = None) -> Tokenizer:
  """The tokenizer a workdir was trained with (its own copy of a BPE file)."""
  config = read_config(workdir) if config is None else config
  return load_tokenizer(resolve_tokenizer_path(os.path.abspath(workdir), config.data.tokenizer))


def frozen_record(workdir: str) -> dict[str, Any] | None:
  """The workdir's record of the frozen parameters it trained against ({"workdir", "step",
  "fingerprint"}), or None for a run without any."""
  path = os.path.join(os.path.abspath(workdir), FROZEN_NAME)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def params_fingerprint(params: Any) -> str:
  """A short hash identifying a parameter tree: the tree's paths and shapes and the first
  elements of every leaf, read exactly (the same on any mesh; the leaves' gather runs on
  the device, so sharded and multi-host trees work)."""
  leaves = jax.tree_util.tree_leaves_with_path(params)
  heads = jax.jit(lambda xs: [x.reshape(-1)[:_FINGERPRINT_ELEMENTS].astype(jnp.float32) for x in xs])(
    [x for _, x in leaves]
  )
  digest = hashlib.sha256()
  for (path, leaf), head in zip(leaves, heads):
    digest.update(f"{jax.tree_util.keystr(path)}{tuple(leaf.shape)}".encode())
    digest.update(np.asarray(jax.device_get(head)).tobytes())
  return digest.hexdigest()[:16]


_FINGERPRINT_ELEMENTS = 4096


class FrozenParams(NamedTuple):
  """A family's frozen parameters (`ModelFamily.frozen_source`), restored.

  Attributes:
    params: {name: parameter tree}, what the trainer merges into the trained parameters.
    workdir, step: the run and checkpoint step they come from.
    fingerprint: `params_fingerprint(params)`, recorded with the run that trains against them.
  """

  params: dict[str, Any]
  workdir: str
  step: int
  fingerprint: str


def load_frozen_params(config: ModelConfig, mesh: jax.sharding.Mesh | None = None, *, log=None) -> FrozenParams | None:
  """The frozen parameters config's family trains against, restored into `mesh` (None: one
  device), or None for a family without any.

  Raises ValueError when the source run's model does not fit (the message lists the
  fields), FileNotFoundError / CheckpointError when it cannot be read."""
  hook = family_of(config).frozen_source
  if hook is None:
    return None
  source = hook(config)
  saved = ModelConfig.from_mapping(read_config(source.workdir, what=source.setting).model)
  differing = source.differences(saved)
  if differing:
    raise ValueError(
      f"{source.setting}={source.workdir} holds another model than this config expects: "
      f"{'; '.join(differing)}. Copy that run's model values into this config"
    )
  abstract = abstract_params(build_model(source.model_config), 8, mesh=mesh)
  params, step = restore_source_params(
    source.workdir,
    source.model_config,
    abstract,
    step=source.step,
    log=log,
    what=source.setting,
    step_setting=source.step_setting,
  )
  frozen = {source.name: params}
  return FrozenParams(frozen, source.workdir, step, params_fingerprint(frozen))


def with_hf_frozen_source(config: ml_collections.ConfigDict) -> tuple[ml_collections.ConfigDict, str | None]:
  """A training config whose family's frozen source (a LongSpec draft's target) is a Hugging
  Face model directory, with the model.* fields that the source fixes (`FrozenSource.adopt`)
  and data.tokenizer taken from that directory, and a note naming what changed (None when
  nothing did). Any other config comes back unchanged.

  A trained target's widths are checked against the config instead (the draft configs are
  written beside their target's); no config file mirrors a Hugging Face model's config.json.
  """
  model_config = ModelConfig.from_mapping(config.model)
  hook = family_of(model_config).frozen_source
  source = hook(model_config) if hook is not None else None
  if source is None or not hf.is_hf_model_dir(source.workdir):
    return config, None
  ours, theirs = model_config.to_mapping(), source.adopt(hf.hf_model_config(source.workdir)).to_mapping()
  changed = {key: value for key, value in theirs.items() if ours[key] != value}
  if config.data.tokenizer != source.workdir:
    changed["data.tokenizer"] = source.workdir
  if not changed:
    return config, None
  config = copy.deepcopy(config)
  with config.unlocked():
    for key, value in changed.items():
      if key == "data.tokenizer":
        config.data.tokenizer = value
      else:
        config.model[key] = value
  settings = ", ".join(
    f"{key if key.startswith('data.') else 'model.' + key}={value!r}" for key, value in changed.items()
  )
  return config, f"{source.setting}={source.workdir} is a Hugging Face model directory: took {settings} from it"


def load_draft(
  draft_workdir: str,
  target: TrainedModel,
  *,
  step: int | None = None,
  log=None,
  mesh: jax.sharding.Mesh | None = None,
  flag: str = "--tensor",
) -> TrainedModel:
  """A LongSpec draft trained for `target` (from `load_trained_model`): (model, params,
  tokenizer, step) of `draft_workdir`'s newest good (or `step`) checkpoint.

  Raises ValueError when the draft is not a LongSpec draft, its widths are not the
  target's, or it was trained against other target parameters (their fingerprints
  differ). mesh, flag: as `load_trained_model` takes them (the target's mesh)."""
  draft = load_trained_model(draft_workdir, step, log=log, mesh=mesh, flag=flag)
  if draft.model.config.family != longspec_draft.FAMILY:
    raise ValueError(
      f"--draft_workdir={draft_workdir} holds a {draft.model.config.family!r} model, not a "
      f"{longspec_draft.FAMILY!r} draft"
    )
  differing = longspec_draft.width_differences(target.model.config, draft.model.config)
  if differing:
    raise ValueError(f"the draft in {draft_workdir} was built for another target: {'; '.join(differing)}")
  record = frozen_record(draft_workdir)
  theirs = params_fingerprint({longspec_draft.TARGET: target.params})
  if record is not None and record.get("fingerprint") != theirs:
    raise ValueError(
      f"the draft in {draft_workdir} was trained for the target in {record.get('workdir')} (step "
      f"{record.get('step')}, fingerprint {record.get('fingerprint')}), not for this target (fingerprint "
      f"{theirs}): train a draft for this target, or pass the target it was trained for"
    )
  return draft
