"""TFDS dataset `python_stdlib`: the .py source files of the running Python's
standard library (or of any directory), as long real documents.

It is present on every machine, so the default training corpus needs no download.
Contents differ between Python versions, so the builder config is named after the
version (e.g. `py3_12`); a directory given by `data.source_dir` gets a config
named after a hash of its absolute path. The split is by a hash of each file's
relative path: stable across machines and runs, ~5% validation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import sysconfig

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
      name=f"py{major}_{minor}", source_dir=sysconfig.get_paths()["stdlib"],
      description=f"Python {major}.{minor} standard library sources")


def directory_config(source_dir: str) -> PythonSourceConfig:
  source_dir = os.path.abspath(source_dir)
  digest = hashlib.sha256(source_dir.encode()).hexdigest()[:12]
  return PythonSourceConfig(name=f"dir_{digest}", source_dir=source_dir, description=f".py files under {source_dir}")


def list_source_files(source_dir: str) -> list[str]:
  """Relative paths of the .py files under source_dir, sorted."""
  if not os.path.isdir(source_dir):
    raise ValueError(f"Corpus directory {source_dir!r} does not exist (data.source_dir)")
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
        supervised_keys=None)

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    paths = list_source_files(self.builder_config.source_dir)
    if not paths:
      raise ValueError(f"No .py files under {self.builder_config.source_dir!r}: the corpus would be empty")
    train, validation = split_files(paths)
    return {"train": self._generate_examples(train), "validation": self._generate_examples(validation)}

  def _generate_examples(self, paths):
    for relative in paths:
      try:
        with open(os.path.join(self.builder_config.source_dir, relative), encoding="utf-8") as f:
          text = f.read()
      except (UnicodeDecodeError, OSError):
        continue  # a few stdlib test files are deliberately not UTF-8
      if text:
        yield relative, {"text": text, "path": relative}
