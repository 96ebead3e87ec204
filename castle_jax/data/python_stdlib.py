"""TFDS dataset `python_stdlib`: the .py source files of the running Python's
standard library (or of any directory), as long real documents.

It is present on every machine, so the default training corpus needs no download.
Contents differ between Python versions, so the builder config is named after the
version (e.g. `py3_12`); a directory given by `data.source_dir` gets a config
named after a hash of its absolute path and of its contents (every .py file's
relative path, size and modification time), so adding, deleting or editing a file
builds a new cache (the old one stays in data_dir; nothing is deleted). The split
is by a hash of each file's relative path: stable across machines and runs, ~5%
validation; a corpus needs at least 2 usable files so that each split gets one.
Files that are not UTF-8 text are left out with a warning naming them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig
import warnings

import tensorflow_datasets as tfds

VALIDATION_PERCENT = 5
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(eq=False)
class PythonSourceConfig(tfds.core.BuilderConfig):
  """source_dir: the directory whose .py files (recursively) form the corpus."""

  source_dir: str = ""


def stdlib_config() -> PythonSourceConfig:
  major, minor = sys.version_info[:2]
  return PythonSourceConfig(
    name=f"py{major}_{minor}",
    source_dir=sysconfig.get_paths()["stdlib"],
    description=f"Python {major}.{minor} standard library sources",
  )


def contents_key(source_dir: str, paths: list[str]) -> str:
  """A hash of the directory and of each file's relative path, size and mtime."""
  digest = hashlib.sha256(os.path.abspath(source_dir).encode())
  for relative in paths:
    stat = os.stat(os.path.join(source_dir, relative))
    digest.update(f"\0{relative}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
  return digest.hexdigest()[:16]


def directory_config(source_dir: str) -> PythonSourceConfig:
  """The builder config of a directory's corpus, named after its contents.

  Raises ValueError (naming data.source_dir) when the directory is missing or
  has fewer than 2 .py files, before any cache folder is created."""
  source_dir = os.path.abspath(source_dir)
  paths = list_source_files(source_dir)
  if not paths:
    raise ValueError(f"data.source_dir {source_dir!r} has no .py files: the corpus would be empty")
  if len(paths) < 2:
    raise ValueError(
      f"data.source_dir {source_dir!r} has only one .py file ({paths[0]}): the train and validation "
      "splits need at least one document each; add more .py files"
    )
  return PythonSourceConfig(
    name=f"dir_{contents_key(source_dir, paths)}", source_dir=source_dir, description=f".py files under {source_dir}"
  )


def list_source_files(source_dir: str) -> list[str]:
  """Relative paths of the .py files under source_dir, sorted."""
  if not os.path.isdir(source_dir):
    kind = "is not a directory" if os.path.exists(source_dir) else "does not exist"
    raise ValueError(f"data.source_dir {source_dir!r} {kind}")
  found = []
  for root, dirs, files in os.walk(source_dir):
    dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
    found.extend(os.path.relpath(os.path.join(root, f), source_dir) for f in files if f.endswith(".py"))
  return sorted(found)


def is_validation(relative_path: str) -> bool:
  bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 100
  return bucket < VALIDATION_PERCENT


def split_files(paths: list[str]) -> tuple[list[str], list[str]]:
  """(train, validation); with 2+ files each split gets at least one."""
  validation = [p for p in paths if is_validation(p)]
  train = [p for p in paths if not is_validation(p)]
  if len(paths) >= 2 and not validation:
    validation = [min(train, key=lambda p: hashlib.sha256(p.encode()).hexdigest())]
    train = [p for p in train if p not in validation]
  if len(paths) >= 2 and not train:
    train = [validation.pop()]
  return train, validation


class PythonStdlib(tfds.core.GeneratorBasedBuilder):
  """Python source files as documents: features `text` (the file) and `path`."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "First release."}
  BUILDER_CONFIGS = [stdlib_config()]

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
      description=__doc__,
      features=tfds.features.FeaturesDict({"text": tfds.features.Text(), "path": tfds.features.Text()}),
      supervised_keys=None,
    )

  # TFDS announces "Downloading and preparing dataset Unknown size (download: Unknown size,
  # ...)" and then "downloaded": nothing is downloaded here, the files are read from disk.
  def _log_download_bytes(self) -> None:
    print(
      f"Building the {self.name} corpus from {self.builder_config.source_dir} into {self.data_dir} "
      "(once; later runs reuse it)",
      file=sys.stderr,
      flush=True,
    )

  def _log_download_done(self) -> None:
    print(f"Built the {self.name} corpus in {self.data_dir}", file=sys.stderr, flush=True)

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    source_dir = self.builder_config.source_dir
    paths, unreadable = usable_source_files(source_dir)
    if unreadable:
      warnings.warn(
        f"{len(unreadable)} .py file(s) under {source_dir} are not UTF-8 text or cannot be read and are left "
        f"out of the corpus: {', '.join(unreadable[:5])}{', ...' if len(unreadable) > 5 else ''}"
      )
    if len(paths) < 2:
      raise ValueError(
        f"data.source_dir {source_dir!r} has {len(paths)} usable (non-empty UTF-8) .py file(s): the train and "
        "validation splits need at least one document each"
      )
    train, validation = split_files(paths)
    return {"train": self._generate_examples(train), "validation": self._generate_examples(validation)}

  def _generate_examples(self, paths):
    for relative in paths:
      with open(os.path.join(self.builder_config.source_dir, relative), encoding="utf-8") as f:
        yield relative, {"text": f.read(), "path": relative}


def usable_source_files(source_dir: str) -> tuple[list[str], list[str]]:
  """(non-empty UTF-8 .py files, files that are not UTF-8 or cannot be read), relative paths.

  Empty files (e.g. `__init__.py`) are neither: they hold no text."""
  usable, unreadable = [], []
  for relative in list_source_files(source_dir):
    try:
      with open(os.path.join(source_dir, relative), encoding="utf-8") as f:
        text = f.read()
    except (UnicodeDecodeError, OSError):
      unreadable.append(relative)  # a few stdlib test files are deliberately not UTF-8
      continue
    if text:
      usable.append(relative)
  return usable, unreadable
