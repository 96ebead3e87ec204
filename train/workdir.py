"""Who owns a workdir, and what a new run may do to the files already in it.

A workdir holds one run: `checkpoints/`, `metrics.jsonl`, `tensorboard/`,
`config.json` and (for a BPE run) `tokenizer.json`. The rules:

- One process writes into it at a time: `WorkdirLock` holds an exclusive
  `fcntl.flock` on `<workdir>/.lock`, which records the holder's pid, host and
  start time. The kernel drops the lock when the holder exits, however it exits,
  so a lock left by a dead run is taken over (with a warning naming it); a second
  live run fails at once with one line naming the holder.
- `train.resume=True` (default) continues the run in the workdir. `resume=False`
  on a workdir that already holds a run is an error, unless
  `train.overwrite=True`, which MOVES the old run to a sibling folder
  `<workdir>.old-<UTC time>` (nothing is deleted).
- `config.json` is written only after the new config was validated, the model
  built and the checkpoint restored; a rerun whose `model.*` settings differ from
  the saved config.json fails before anything is touched.

With several processes (`jax.process_count() > 1`) only process 0 takes the lock
and writes files; every process takes the same decisions from the (shared)
filesystem, and process 0's lock result is broadcast so all of them fail together.
"""

from __future__ import annotations

import copy
import errno
import fcntl
import json
import os
import shutil
import socket
import time
import warnings
from typing import Any, Mapping

import jax

from castle_jax.checkpoints import file_sha256
from castle_jax.models import ModelConfig, family_of
from castle_jax.workdir import (
  CONFIG_NAME,
  FROZEN_NAME,
  TOKENIZER_NAME,
  read_config,
  resolve_tokenizer_path,
  saved_config,
)
from train.config import base_config

LOCK_NAME = ".lock"
# Entries that make a workdir "hold a run".
_RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard", CONFIG_NAME)


class WorkdirBusyError(RuntimeError):
  """Another live process holds the workdir's lock."""


class WorkdirNotEmptyError(ValueError):
  """A fresh run (`resume=False`) was asked for in a workdir that holds a run."""


class ConfigMismatchError(ValueError):
  """The new config's model differs from the one the workdir's checkpoints were trained with."""


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _agree(ok: bool, what: str) -> None:
  """Multi-process: every process learns process 0's `ok` (a collective, so all
  processes must call it in the same order)."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils

  agreed = bool(multihost_utils.broadcast_one_to_all(jax.numpy.asarray(ok)))
  if not agreed and jax.process_index() != 0:
    raise RuntimeError(f"Process 0 failed to {what}; see its log")


class WorkdirLock:
  """An exclusive lock on `<workdir>/.lock` (pid, host and start time inside).

  `acquire()` raises WorkdirBusyError naming the holder when a live process holds
  it; a lock file left by a process that died is taken over with a warning.
  Use as a context manager or call `release()`.
  """

  def __init__(self, workdir: str):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_NAME)
    self._fd: int | None = None

  def acquire(self) -> "WorkdirLock":
    os.makedirs(self.workdir, exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
          raise
        holder = self.holder()
        who = (
          f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')})"
          if holder
          else "another process"
        )
        raise WorkdirBusyError(
          f"Workdir {self.workdir} is in use by {who}: wait for that run to end or stop it, "
          f"or use another --workdir (lock file {self.path})"
        ) from None
      # The file may have been removed (released) between open and flock: retry on the new one.
      try:
        same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    previous = self._read(fd)
    if previous and previous.get("pid") != os.getpid():
      alive = previous.get("host") == socket.gethostname() and _pid_alive(int(previous.get("pid", -1)))
      warnings.warn(
        f"Taking over a stale lock on {self.workdir} left by pid {previous.get('pid')} on host "
        f"{previous.get('host')} (started {previous.get('started')})"
        + (" — that pid is alive but does not hold the lock" if alive else ", which is no longer running"),
        stacklevel=2,
      )
    record = {
      "pid": os.getpid(),
      "host": socket.gethostname(),
      "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.fsync(fd)
    self._fd = fd
    return self

  @staticmethod
  def _read(fd: int) -> dict[str, Any]:
    try:
      raw = os.pread(fd, 4096, 0)
      return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
      return {}

  def holder(self) -> dict[str, Any]:
    """The recorded holder (pid, host, started), or {} when unknown."""
    try:
      with open(self.path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return {}

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None

  @property
  def held(self) -> bool:
    return self._fd is not None

  def __enter__(self):
    return self.acquire()

  def __exit__(self, *exc):
    self.release()


def acquire_lock(workdir: str) -> WorkdirLock | None:
  """Process 0 takes the lock (returned); other processes get None. All fail together."""
  lock = None
  error = None
  if jax.process_index() == 0:
    try:
      lock = WorkdirLock(workdir).acquire()
    except WorkdirBusyError as e:
      error = e
  _agree(error is None, f"lock the workdir {workdir}")
  if error is not None:
    raise error
  return lock


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


def _flat(mapping: Mapping[str, Any], prefix: str) -> dict[str, Any]:
  out = {}
  for key, value in mapping.items():
    if isinstance(value, Mapping):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def model_differences(saved_model: Mapping[str, Any], model_config) -> list[str]:
  """`model.key: old -> new` for every key where a saved config.json's model section
  differs from `model_config` (a ConfigDict).

  A key the saved config lacks (added to the schema after that run) counts as
  unchanged when the new value is the schema default, which by convention keeps
  the old behaviour."""
  old = _flat(saved_model, "model.")
  new = _flat(json.loads(model_config.to_json_best_effort()), "model.")
  defaults = _flat(json.loads(base_config().model.to_json_best_effort()), "model.")
  unset = "<unset>"
  differing = []
  for key in sorted(set(old) | set(new)):
    before = old.get(key, defaults.get(key, unset))
    after = new.get(key, unset)
    if before != after:
      differing.append(f"{key}: {before!r} -> {after!r}")
  return differing


def check_model_unchanged(workdir: str, model_config) -> None:
  """Raises ConfigMismatchError (one line listing `model.key: old -> new`) when the
  workdir's saved config.json has a different model (see `model_differences`)."""
  saved = saved_config(workdir)
  if saved is None or "model" not in saved:
    return
  differing = model_differences(saved["model"], model_config)
  if differing:
    raise ConfigMismatchError(
      f"The checkpoints in {workdir} were trained with another model config ({'; '.join(differing)}). "
      "Restore those values to resume, or start over in a new --workdir (or with "
      "--config.train.resume=False --config.train.overwrite=True)."
    )


def check_init_from(source: str, model_config, tokenizer: str) -> None:
  """`train.init_from`: the source workdir must hold a run (config.json) with the
  same model config and the same tokenizer as this one.

  Raises:
    FileNotFoundError: `source` has no config.json.
    ConfigMismatchError: one line listing the differing model.* keys, or naming the tokenizers.
  """
  source = os.path.abspath(source)
  saved = read_config(source, what=f"train.init_from={source}").to_dict()
  training_only = family_of(ModelConfig.from_mapping(model_config)).training_only_kwargs
  differing = [
    line
    for line in model_differences(saved.get("model", {}), model_config)
    if not any(line.startswith(f"model.family_kwargs.{key}:") for key in training_only)
  ]
  if differing:
    raise ConfigMismatchError(
      f"train.init_from={source} was trained with another model config ({'; '.join(differing)}): "
      "its parameters only fit the same model.* values; set them, or init from another run"
    )
  check_same_tokenizer(source, tokenizer, what=f"train.init_from={source}", fix="to fine-tune from that run")


def check_same_tokenizer(source: str, tokenizer: str, *, what: str, fix: str = "") -> None:
  """The run in `source` (a workdir) must have used `tokenizer` (data.tokenizer): the same
  setting, or a BPE file with the same contents. ConfigMismatchError names `what`."""
  saved = read_config(source, what=what).to_dict()
  theirs = resolve_tokenizer_path(source, saved["data"]["tokenizer"])
  same = theirs == tokenizer or (
    "byte" not in (theirs, tokenizer)
    and os.path.isfile(theirs)
    and os.path.isfile(tokenizer)
    and file_sha256(theirs) == file_sha256(tokenizer)
  )
  if not same:
    raise ConfigMismatchError(
      f"data.tokenizer {tokenizer} differs from the tokenizer of {what} ({theirs}); "
      f"pass --config.data.tokenizer={theirs}" + (f" {fix}" if fix else "")
    )


def check_tokenizer_unchanged(workdir: str, tokenizer: str) -> None:
  """A resumed BPE run must use the tokenizer file it was trained with."""
  copy = os.path.join(workdir, TOKENIZER_NAME)
  if tokenizer == "byte" or not os.path.isfile(copy) or not os.path.isfile(tokenizer):
    return
  if os.path.abspath(tokenizer) != os.path.abspath(copy) and file_sha256(tokenizer) != file_sha256(copy):
    raise ConfigMismatchError(
      f"data.tokenizer {tokenizer} differs from the tokenizer the checkpoints in {workdir} were trained "
      f"with ({copy}); pass --config.data.tokenizer={copy} to resume, or start over in a new --workdir"
    )


def write_run_files(workdir: str, config) -> None:
  """Writes config.json (atomically) and copies a BPE tokenizer file into the
  workdir, so the workdir is self-contained: config.json names the tokenizer
  relative to the workdir. Process 0 only; call after restore succeeded."""
  if jax.process_index() != 0:
    return
  config = copy.deepcopy(config)
  with config.unlocked():
    tokenizer = config.data.tokenizer
    if tokenizer != "byte":
      destination = os.path.join(workdir, TOKENIZER_NAME)
      if os.path.abspath(tokenizer) != os.path.abspath(destination):
        temporary = destination + ".tmp"
        shutil.copyfile(tokenizer, temporary)
        os.replace(temporary, destination)
      config.data.tokenizer = TOKENIZER_NAME  # relative to the workdir
    config.workdir = workdir
  path = os.path.join(workdir, CONFIG_NAME)
  temporary = path + ".tmp"
  with open(temporary, "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  os.replace(temporary, path)


def write_frozen_record(workdir: str, *, source: str, step: int, fingerprint: str) -> None:
  """Records (atomically, process 0) which frozen parameters the run trains against, so
  that its checkpoints are never used with others (`castle_jax.workdir.load_draft`)."""
  if jax.process_index() != 0:
    return
  path = os.path.join(workdir, FROZEN_NAME)
  temporary = path + ".tmp"
  with open(temporary, "w") as f:
    json.dump({"workdir": source, "step": step, "fingerprint": fingerprint}, f, indent=2)
  os.replace(temporary, path)
