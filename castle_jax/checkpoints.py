"""Orbax checkpoints of the train state together with the grain iterator state,
verified by a checksum manifest per step.

Layout: `<workdir>/checkpoints/<step>/` (Orbax: `state/`, `data_iter/`, metadata)
plus `<step>/manifest.sha256.json`, the size and sha256 of every file of the step,
written once Orbax has finalized the step (saves are asynchronous: the manifest of
a step is written at the next save, `wait()` or `close()`). On restore each step is
checked against its manifest; a step that fails the check or that Orbax cannot read
is reported in one line naming the step and the file, moved aside to
`<workdir>/checkpoints_set_aside/` (never deleted), and the newest good step is
used instead, with a loud warning. `resume_step=N` picks a step.

The trainer writes through `Checkpointer`; evaluation and fine-tuning read through it
too (`castle_jax.workdir`), which is why it lives in the library.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from concurrent import futures
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

MANIFEST_NAME = "manifest.sha256.json"
SET_ASIDE_DIR = "checkpoints_set_aside"


class CheckpointError(RuntimeError):
  """A checkpoint step is missing, corrupt or unreadable (the message names it)."""


def file_sha256(path: str) -> str:
  """Hex sha256 of a file's bytes, read in 4 MiB pieces."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 22), b""):
      digest.update(chunk)
  return digest.hexdigest()


def _step_files(step_dir: str) -> list[str]:
  found = []
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    found.extend(os.path.relpath(os.path.join(root, f), step_dir) for f in sorted(files) if f != MANIFEST_NAME)
  return found


def write_manifest(step_dir: str) -> None:
  """Writes `<step_dir>/manifest.sha256.json`: {"files": {relative path: {size, sha256}}}."""
  files = {}
  for relative in _step_files(step_dir):
    path = os.path.join(step_dir, relative)
    files[relative] = {"size": os.path.getsize(path), "sha256": file_sha256(path)}
  temporary = os.path.join(step_dir, MANIFEST_NAME + ".tmp")
  with open(temporary, "w") as f:
    json.dump({"files": files}, f, indent=0)
  os.replace(temporary, os.path.join(step_dir, MANIFEST_NAME))


def verify_step(step_dir: str) -> str | None:
  """None when every file matches the manifest (or there is no manifest yet, e.g.
  the run was killed before writing it: Orbax's own read then decides); else one
  line saying which file is wrong."""
  manifest_path = os.path.join(step_dir, MANIFEST_NAME)
  if not os.path.isdir(step_dir):
    return f"{step_dir} does not exist"
  if not os.path.exists(manifest_path):
    return None
  try:
    with open(manifest_path) as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError) as e:
    return f"its manifest {manifest_path} is unreadable ({e})"
  for relative, expected in files.items():
    path = os.path.join(step_dir, relative)
    if not os.path.exists(path):
      return f"file {path} is missing"
    size = os.path.getsize(path)
    if size != expected["size"]:
      return f"file {path} has {size} bytes, {expected['size']} were written (truncated or changed)"
    if file_sha256(path) != expected["sha256"]:
      return f"file {path} does not match its checksum (corrupted)"
  return None


@contextlib.contextmanager
def _quiet_absl():
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error).split()).split(" See full TensorStore details")[0]
  return f"{type(error).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


class Checkpointer:
  """Saves (asynchronously) and restores {state, data_iter} under `directory`.

  Orbax writes each step into a temporary directory and renames it when complete,
  so an interrupted save never replaces the last good checkpoint; the manifest
  then lets a restore detect a step that was damaged afterwards.
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True, read_only: bool = False):
    if keep < 1:
      raise ValueError(f"train.keep_checkpoints must be >= 1, got {keep}")
    self.directory = os.path.abspath(directory)
    self._keep = keep
    with _quiet_absl() if read_only else contextlib.nullcontext():  # read_only logs 3 warnings about itself
      options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=not read_only, enable_async_checkpointing=async_save, read_only=read_only
      )
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._pending: list[int] = []  # saved steps whose manifest is not written yet
    self._hasher = futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-manifest")
    self._hashing: list[futures.Future] = []
    self._is_main = jax.process_index() == 0

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any, data_iterator: Any | None = None) -> None:
    self._finish_pending()
    items = {"state": ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items["data_iter"] = grain.checkpoint.CheckpointSave(data_iterator)
    if not self._manager.save(step, args=ocp.args.Composite(**items)):
      # Orbax skips a step that is not newer than its latest one; never lose a save silently.
      raise CheckpointError(
        f"Checkpoint step {step} was not written: {self.directory} already holds steps {self.all_steps()}. "
        "Use a new --workdir, or --config.train.resume=False --config.train.overwrite=True to start over."
      )
    self._pending.append(step)

  def _finish_pending(self) -> None:
    """Waits for the running save, then hashes the finished steps in the background.

    Hashes submitted earlier are awaited first: their steps may be the ones the
    next save removes (max_to_keep), and a manifest must not be written into a
    directory being deleted. With keep=1 the step just finished is removed by
    the next save, so its hash is awaited too."""
    self._manager.wait_until_finished()
    for future in self._hashing:
      future.result()
    self._hashing = []
    if self._is_main:
      for step in self._pending:
        self._hashing.append(self._hasher.submit(self._write_manifest, step))
    self._pending = []
    if self._keep == 1:
      for future in self._hashing:
        future.result()
      self._hashing = []

  def _write_manifest(self, step: int) -> None:
    try:
      write_manifest(self.step_dir(step))
    except FileNotFoundError:
      pass  # Orbax removed the step (max_to_keep) meanwhile

  def verify(self, step: int) -> str | None:
    """None if step `step` matches its manifest, else what is wrong (one line).

    With several processes only process 0 reads and hashes the files; the
    verdict is broadcast so that every process takes the same decision."""
    if jax.process_count() == 1:
      return verify_step(self.step_dir(step))
    from jax.experimental import multihost_utils

    problem = verify_step(self.step_dir(step)) if self._is_main else None
    ok = bool(multihost_utils.broadcast_one_to_all(jax.numpy.asarray(problem is None)))
    return None if ok else (problem or f"step {step} failed verification on process 0 (see its log)")

  def restore(self, step: int, abstract_state: Any, data_iterator: Any | None = None) -> Any:
    """Restores the state into the shardings of `abstract_state`; restores the
    data iterator in place when one is given. Raises CheckpointError (with
    Orbax's error as __cause__) when the step cannot be read."""
    problem = self.verify(step)
    if problem is not None:
      raise CheckpointError(f"Checkpoint step {step} in {self.directory} is damaged: {problem}")
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iterator)
    try:
      return self._manager.restore(step, args=ocp.args.Composite(**items))["state"]
    except Exception as e:  # noqa: BLE001 - Orbax/TensorStore raise many types; all mean "unreadable"
      raise CheckpointError(f"Checkpoint step {step} in {self.directory} cannot be restored: {_one_line(e)}") from e

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Restores only the `params` subtree of the saved state (no optimizer state
    is read or built), into the shardings of `abstract_params`."""
    problem = self.verify(step)
    if problem is not None:
      raise CheckpointError(f"Checkpoint step {step} in {self.directory} is damaged: {problem}")
    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_params)
    args = ocp.args.PyTreeRestore(
      item={"params": abstract_params}, restore_args={"params": restore_args}, partial_restore=True
    )
    try:
      return self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]
    except Exception as e:  # noqa: BLE001
      raise CheckpointError(f"Checkpoint step {step} in {self.directory} cannot be restored: {_one_line(e)}") from e

  def restore_newest_params(self, abstract_params: Any, *, step: int | None = None, log=None) -> tuple[Any, int]:
    """(params, step): the parameters of `step`, or else of the newest step that
    verifies and reads; a damaged newer step is reported (one line each) and skipped.

    Nothing is moved aside: this is the reading side (evaluation, fine-tuning from
    another run's workdir), which must leave that run's files as they are.
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"No checkpoints in {self.directory}")
    if step is not None and step not in steps:
      raise CheckpointError(f"No checkpoint for step {step} in {self.directory}; available: {steps}")
    if step is not None:
      return self.restore_params(step, abstract_params), step
    damaged = []
    for candidate in sorted(steps, reverse=True):
      try:
        params = self.restore_params(candidate, abstract_params)
      except CheckpointError as e:
        log(f"WARNING: {e}; trying the next older step")
        damaged.append(candidate)
        continue
      if damaged:
        log(f"WARNING: using step {candidate} of {self.directory}: the newer step(s) {damaged} are damaged")
      return params, candidate
    raise CheckpointError(
      f"No usable checkpoint in {self.directory}: every step ({damaged}) is damaged (see the lines above)"
    )

  def restore_good(
    self, abstract_state: Any, data_iterator: Any | None = None, *, step: int | None = None, log=None
  ) -> tuple[Any, int, list[tuple[int, str]]]:
    """Restores `step`, or else the newest step that verifies and reads.

    A damaged newer step is reported (one line each), moved aside to
    `checkpoints_set_aside/` (so that later saves of those step numbers are not
    skipped by Orbax) and the next older one is tried, with a loud warning. With
    an explicit `step` there is no fall-back; newer steps are moved aside.

    Returns:
      (state, restored step, [(damaged step, problem), ...]).
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    steps = self.all_steps()
    if step is not None and step not in steps:
      raise CheckpointError(
        f"train.resume_step={step}: there is no checkpoint for step {step} in {self.directory}; available: {steps}"
      )
    damaged: list[tuple[int, str]] = []
    for candidate in [step] if step is not None else sorted(steps, reverse=True):
      try:
        state = self.restore(candidate, abstract_state, data_iterator)
      except CheckpointError as e:
        log(f"ERROR: {e}")
        damaged.append((candidate, str(e)))
        if step is not None:
          raise CheckpointError(
            f"{e}. Pick another step with --config.train.resume_step (available: {steps})"
          ) from e.__cause__
        continue
      newer = [s for s in steps if s > candidate]
      if damaged:
        log(
          f"WARNING: {'!' * 60}\nWARNING: the latest checkpoint(s) {[s for s, _ in damaged]} could not be "
          f"used; RESUMING FROM THE OLDER STEP {candidate}. Steps {candidate + 1}.. will be trained again.\n"
          f"WARNING: {'!' * 60}"
        )
      if newer:
        moved = self.set_aside(newer, "damaged" if step is None else "after-resume-step")
        log(f"WARNING: checkpoint steps {newer} were moved to {moved} (kept, not deleted)")
      return state, candidate, damaged
    if not steps:
      raise CheckpointError(f"No checkpoints in {self.directory}")
    raise CheckpointError(
      f"No usable checkpoint in {self.directory}: every step ({', '.join(str(s) for s, _ in damaged)}) is "
      "damaged (see the lines above). Start over with a new --workdir or --config.train.resume=False "
      "--config.train.overwrite=True (the damaged run is moved aside, not deleted)."
    )

  def set_aside(self, steps: list[int], reason: str) -> str:
    """Moves step directories to `<workdir>/checkpoints_set_aside/` (process 0)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    destination = os.path.join(os.path.dirname(self.directory), SET_ASIDE_DIR)
    if self._is_main:
      os.makedirs(destination, exist_ok=True)
      for step in steps:
        shutil.move(self.step_dir(step), os.path.join(destination, f"{step}.{reason}.{stamp}"))
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices("castle_jax: checkpoints set aside")
    self._manager.reload()
    return destination

  def wait(self) -> None:
    """Blocks until every save has finished and its manifest is written."""
    self._finish_pending()
    for future in self._hashing:
      future.result()
    self._hashing = []

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()
      self._hasher.shutdown(wait=True)
