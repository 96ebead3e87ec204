"""Where commands write their results, without replacing any file they did not write.

A command never writes into the current directory unless told to: its default is under
the workdir it reads, or under the user's cache (`user_cache_dir`: $XDG_CACHE_HOME/castle_jax,
else ~/.cache/castle_jax). A result goes to a name no earlier run used (`publish` links it
into place, failing instead of replacing; `fresh_directory` makes a new one), and a file
the user names must not exist yet (`refuse_existing`, checked before any work).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

from castle_jax.command_line import UsageError


def user_cache_dir(*parts: str) -> str:
  """$XDG_CACHE_HOME/castle_jax/<parts>, else ~/.cache/castle_jax/<parts> (not created)."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "castle_jax", *parts)


def fresh_directory(parent: str, prefix: str = "") -> str:
  """A new directory `<parent>/<prefix><UTC time>` (with a suffix if that exists), created."""
  os.makedirs(parent, exist_ok=True)
  stamp = f"{prefix}{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
  for suffix in range(1000):
    path = os.path.join(parent, stamp if suffix == 0 else f"{stamp}-{suffix}")
    try:
      os.mkdir(path)
      return path
    except FileExistsError:
      continue
  raise FileExistsError(f"no free directory name {stamp}-N in {parent}")


def refuse_existing(flag: str, *paths: str) -> None:
  """UsageError naming `flag` when one of `paths` exists: results are never replaced."""
  existing = [p for p in paths if os.path.lexists(p)]
  if existing:
    raise UsageError(
      f"{flag}: {existing[0]} exists (results of an earlier run are never replaced); pass a new name, "
      "or move that file away first"
    )


def publish(write: Callable[[str], None], stem: str, suffix: str, *, beside: tuple[str, ...] = ()) -> str:
  """Writes a file with `write(path)` under the first free name `<stem><suffix>`,
  `<stem>-2<suffix>`, ... (free: neither it nor `<that stem><s>` for `s` in `beside` exists,
  e.g. the plot of a JSON file). It is written to a temporary file, then linked into place,
  which fails rather than replace a file that appeared meanwhile. Returns the stem used."""
  directory = os.path.dirname(os.path.abspath(stem))
  os.makedirs(directory, exist_ok=True)
  handle, temporary = tempfile.mkstemp(dir=directory, prefix=".writing-", suffix=suffix)
  os.close(handle)
  try:
    write(temporary)
    for number in range(1, 10_000):
      candidate = stem if number == 1 else f"{stem}-{number}"
      if any(os.path.lexists(candidate + other) for other in beside):
        continue
      try:
        os.link(temporary, candidate + suffix)
        return candidate
      except FileExistsError:
        continue
    raise FileExistsError(f"no free name {stem}-N{suffix} in {directory}")
  finally:
    os.unlink(temporary)
