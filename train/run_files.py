"""What a run does with the files of its workdir.

A workdir holds one run: `checkpoints/`, `metrics.jsonl`, `tensorboard/`, `config.json`
and (for a BPE run) `tokenizer.json`; or, with `train.seeds`, `seeds.json` and one such
workdir per seed (`check_layout`). `train.resume=True` (default) continues the run in
the workdir. `resume=False` on a workdir that already holds a run is an error, unless
`train.overwrite=True`, which MOVES the old run to a sibling folder `<workdir>.old-<UTC
time>` (nothing is deleted). `config.json` is written only after the new config was
validated, the model built and the checkpoint restored. With several processes, every
process takes the same decisions from the (shared) filesystem and process 0 writes.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time

import jax

from castle_jax.workdir import CONFIG_NAME, FROZEN_NAME, SEEDS_NAME, TOKENIZER_NAME, seed_workdir, seeds_record
from train.workdir_lock import LOCK_NAME

# Entries that make a workdir "hold a run" (of one seed; SEEDS_NAME: of several).
_ONE_RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", CONFIG_NAME)
_RUN_FILES = (*_ONE_RUN_FILES, SEEDS_NAME)


class WorkdirNotEmptyError(ValueError):
  """A fresh run (`resume=False`) was asked for in a workdir that holds a run."""


def previous_run(workdir: str) -> list[str]:
  """The run files already in `workdir` (empty when it holds no run)."""
  if not os.path.isdir(workdir):
    return []
  found = []
  for name in _RUN_FILES:
    path = os.path.join(workdir, name)
    if os.path.isdir(path) and os.listdir(path) or os.path.isfile(path):
      found.append(name)
  return found


def check_layout(workdir: str, seeds: int | None) -> None:
  """Raises ValueError when the run a workdir holds is not of the kind asked for: one run
  (`seeds` None) or `seeds` seeds (`train.seeds`), each in `seed_workdir(workdir, k)`."""
  record = seeds_record(workdir)
  if seeds is None:
    if record is not None:
      raise ValueError(
        f"Workdir {workdir} holds a run of {record['seeds']} seeds ({SEEDS_NAME}): pass "
        f"--config.train.seeds={record['seeds']} to continue it, --workdir={seed_workdir(workdir, 0)} to work on "
        "one seed alone, or a new --workdir"
      )
    return
  single = [name for name in previous_run(workdir) if name in _ONE_RUN_FILES]
  if single:
    raise ValueError(
      f"Workdir {workdir} holds a single-seed run ({', '.join(single)}); train.seeds={seeds} puts seed k in "
      f"{seed_workdir(workdir, '<k>')}/ and never beside another run: use a new --workdir"
    )
  if record is not None and record["seeds"] != seeds:
    raise ValueError(
      f"Workdir {workdir} holds a run of {record['seeds']} seeds, not train.seeds={seeds}: pass "
      f"--config.train.seeds={record['seeds']} to continue it, or use a new --workdir"
    )


def write_seeds_record(workdir: str, *, seeds: int, seeds_mode: str) -> None:
  """Writes (atomically, process 0) the record that makes `workdir` a run of several seeds."""
  if jax.process_index() == 0:
    _write_json(os.path.join(workdir, SEEDS_NAME), {"seeds": seeds, "seeds_mode": seeds_mode})


def _write_json(path: str, record: dict) -> None:
  """Writes `record` to `path` atomically (a temporary file, then a rename). The temporary
  file is the process's own: processes training other seed indices of one run of several
  (`train.seed_indices`) write the same seeds.json at once."""
  temporary = f"{path}.tmp{os.getpid()}"
  with open(temporary, "w") as f:
    json.dump(record, f, indent=2)
  os.replace(temporary, path)


def claim_for_fresh_run(workdir: str, *, resume: bool, overwrite: bool) -> str | None:
  """Applies the resume/overwrite rules before a run starts.

  Returns the folder the old run was moved to (overwrite), else None. Raises
  WorkdirNotEmptyError for `resume=False` on a workdir that holds a run.
  """
  found = previous_run(workdir)
  if not found or resume:
    return None
  if not overwrite:
    raise WorkdirNotEmptyError(
      f"Workdir {workdir} already holds a run ({', '.join(found)}) and train.resume=False would mix two "
      "runs in it. Continue it (drop --config.train.resume=False), start over in a new --workdir, or "
      "pass --config.train.overwrite=True to move the old run aside (to a sibling folder "
      f"{os.path.basename(workdir)}.old-<time>; nothing is deleted)."
    )
  destination = f"{workdir}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
  suffix = 1
  while os.path.exists(destination):
    destination = f"{workdir}.old-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{suffix}"
    suffix += 1
  if jax.process_index() == 0:
    os.makedirs(destination)
    for name in sorted(os.listdir(workdir)):
      if name != LOCK_NAME:
        shutil.move(os.path.join(workdir, name), os.path.join(destination, name))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("castle_jax: old run moved aside")
  return destination


def write_run_files(workdir: str, config) -> None:
  """Writes config.json (atomically) and copies a BPE tokenizer file into the
  workdir, so the workdir is self-contained: config.json names the tokenizer
  relative to the workdir (a Hugging Face model directory as data.tokenizer is named by
  its absolute path instead), and train.init_from (where a fine-tuning run started: a
  workdir or a Hugging Face model directory) by its absolute path. Process 0 only; call
  after restore succeeded."""
  if jax.process_index() != 0:
    return
  config = copy.deepcopy(config)
  with config.unlocked():
    tokenizer = config.data.tokenizer
    if os.path.isdir(tokenizer):
      # A Hugging Face model directory's special ids live in its config.json: it is named, not copied.
      config.data.tokenizer = os.path.abspath(tokenizer)
    elif tokenizer != "byte":
      destination = os.path.join(workdir, TOKENIZER_NAME)
      if os.path.abspath(tokenizer) != os.path.abspath(destination):
        temporary = destination + ".tmp"
        shutil.copyfile(tokenizer, temporary)
        os.replace(temporary, destination)
      config.data.tokenizer = TOKENIZER_NAME  # relative to the workdir
    if config.train.get("init_from"):
      config.train.init_from = os.path.abspath(config.train.init_from)
    config.workdir = workdir
  path = os.path.join(workdir, CONFIG_NAME)
  temporary = path + ".tmp"
  with open(temporary, "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  os.replace(temporary, path)


def write_frozen_record(workdir: str, *, source: str, step: int, fingerprint: str) -> None:
  """Records (atomically, process 0) which frozen parameters the run trains against, so
  that its checkpoints are never used with others (`castle_jax.workdir.load_draft`)."""
  if jax.process_index() == 0:
    _write_json(os.path.join(workdir, FROZEN_NAME), {"workdir": source, "step": step, "fingerprint": fingerprint})
