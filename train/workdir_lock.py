"""One process writes into a workdir at a time.

`WorkdirLock` holds an exclusive `fcntl.flock` on `<workdir>/.lock`, which records the
holder's pid, host and start time. The kernel drops the lock when the holder exits,
however it exits, so a lock left by a dead run is taken over (with a warning naming it);
a second live run fails at once with one line naming the holder.

With several processes (`jax.process_count() > 1`) only process 0 takes the lock;
its result is broadcast so all of them fail together.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import warnings
from typing import Any

import jax

LOCK_NAME = ".lock"


class WorkdirBusyError(RuntimeError):
  """Another live process holds the workdir's lock."""


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
