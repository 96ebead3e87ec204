"""`--config=FILE` and `--config.KEY=VALUE` of the commands that take a training config
(`python -m train`, `python -m benchmarks.train_loop`, `python -m benchmarks.train_throughput`):
a missing or misspelled file, an error inside it (with its line) and an unknown or badly
typed override each end in one `ERROR: ...` line (`--traceback`: the full traceback).

ml_collections loads the file while absl parses the flags; a failure there is a long
traceback or a repr of the whole config. So `config_flags_parser` loads the file once
itself first, where an error can be traced to its line, then lets absl parse.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import traceback
from typing import Any

import ml_collections
from absl import flags

from castle_jax.command_line import UsageError, exit_with_error, explain_flag_error, one_line

CONFIG_HELP = "`python -m train --config_help` lists every key"
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")
_KINDS = {int: "an integer", float: "a number", bool: "True or False", str: "a string"}
_LOCKED_KEY = re.compile(r'Key "([^"]+)" does not exist and cannot be added since the config is locked')


def config_argument(argv: list[str]) -> str | None:
  """The value of --config in `argv` (without the program name), or None."""
  for index, argument in enumerate(argv):
    if argument.startswith("--config="):
      return argument.split("=", 1)[1]
    if argument == "--config" and index + 1 < len(argv):
      return argv[index + 1]
  return None


def overrides(argv: list[str]) -> list[tuple[str, str]]:
  """(key, value) of every --config.KEY=VALUE in `argv`."""
  found = []
  for argument in argv:
    if argument.startswith("--config."):
      key, _, value = argument[len("--config.") :].partition("=")
      found.append((key, value))
  return found


def _missing_file_message(path: str) -> str:
  directory = os.path.dirname(path) or "."
  if os.path.isdir(path):
    return f"--config={path} is a directory; pass a config file in it, e.g. --config={os.path.join(path, 'tiny.py')}"
  if os.path.isdir(directory):
    names = [n for n in os.listdir(directory) if n.endswith(".py") and not n.startswith("_")]
    close = difflib.get_close_matches(os.path.basename(path), names, n=1)
    if close:
      return f"--config={path}: no such file; did you mean --config={os.path.join(os.path.dirname(path), close[0])}?"
    return f"--config={path}: no such file in {directory} ({len(names)} config files there)"
  return (
    f"--config={path}: no such file or directory (relative paths start from {os.getcwd()}; "
    "the configs of this repository are in configs/, e.g. --config=configs/tiny.py)"
  )


def _error_line(error: BaseException, path: str) -> str:
  """'FILE, line N (`source`)' of where `error` was raised in the config file (or a file
  beside it that it imports), or the file alone."""
  if isinstance(error, SyntaxError) and error.filename and os.path.abspath(error.filename) == path:
    return f"{error.filename}, line {error.lineno}"
  here = os.path.dirname(path)
  frames = [
    f for f in traceback.extract_tb(error.__traceback__) if os.path.dirname(os.path.abspath(f.filename)) == here
  ]
  if not frames:
    return path
  frame = frames[-1]
  source = f" (`{frame.line.strip()}`)" if frame.line else ""
  return f"{frame.filename}, line {frame.lineno}{source}"


def _all_key_names() -> list[str]:
  from train.config import base_config

  names = []

  def walk(config):
    for key in config.keys():
      names.append(key)
      if isinstance(config[key], ml_collections.ConfigDict):
        walk(config[key])

  walk(base_config())
  return sorted(set(names))


def _describe(error: BaseException) -> str:
  locked = _LOCKED_KEY.search(str(error))
  if locked:
    key = locked.group(1)
    close = difflib.get_close_matches(key, _all_key_names(), n=1)
    return f"unknown config key {key!r}" + (f"; did you mean {close[0]!r}?" if close else "") + f" ({CONFIG_HELP})"
  if isinstance(error, SyntaxError):
    return f"SyntaxError: {error.msg}"
  return f"{type(error).__name__}: {one_line(error)[:300]}"


def load_config_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of the config file at `path` (the part of --config before any ':'
  argument is passed to it). Raises UsageError naming the file (and line) on any failure."""
  file_path, _, argument = path.partition(":")
  if not os.path.isfile(file_path):
    raise UsageError(_missing_file_message(file_path))
  absolute = os.path.abspath(file_path)
  try:
    spec = importlib.util.spec_from_file_location("_castle_jax_checked_config", absolute)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
      raise UsageError(f"--config={path}: {file_path} defines no get_config() (see configs/tiny.py)")
    config = module.get_config(*([argument] if argument else []))
  except UsageError:
    raise
  except Exception as e:  # noqa: BLE001 - any error of the user's file is reported with its line
    raise UsageError(f"--config={path}: {_error_line(e, absolute)}: {_describe(e)}") from e
  if not isinstance(config, ml_collections.ConfigDict):
    raise UsageError(f"--config={path}: get_config() returned {type(config).__name__}, not a ConfigDict")
  return config


def _lookup(config: Any, key: str) -> tuple[bool, Any, str]:
  """(whether `key` ('a.b.c') exists in `config`, its value, the deepest existing section)."""
  node, section = config, ""
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False, None, section
    node = node[part]
    section = f"{section}.{part}" if section else part
  return True, node, section


# Config sections that are free-form dicts of a model family's or attention's own options.
_FREE_FORM_SECTIONS = ("model.family_kwargs", "model.attention_kwargs")


def _explain_override(error: BaseException, argv: list[str], config: ml_collections.ConfigDict) -> str | None:
  for key, value in overrides(argv):
    found, current, section = _lookup(config, key)
    if not found:
      parent = config if not section else _lookup(config, section)[1]
      name = key[len(section) + 1 :].split(".")[0] if section else key.split(".")[0]
      keys = list(parent.keys()) if isinstance(parent, ml_collections.ConfigDict) else []
      close = difflib.get_close_matches(name, keys, n=1)
      where = f"section {section!r}" if section else "the config"
      if section in _FREE_FORM_SECTIONS:
        # These dicts hold only the keys the config file set; a new key means passing the whole dict.
        shown = dict(parent) if isinstance(parent, ml_collections.ConfigDict) else {}
        return (
          f"--config.{key}={value}: {section} holds only the keys its config file sets ({sorted(keys)}); "
          f'to set {name!r}, pass the whole dict: --config.{section}="{ {**shown, name: "..."} }"'
        )
      suggestion = f"; did you mean --config.{section + '.' if section else ''}{close[0]}?" if close else ""
      return f"--config.{key}={value}: {where} has no key {name!r}{suggestion} ({CONFIG_HELP})"
    if f"--config.{key}=" in str(error):
      expected = _KINDS.get(type(current), type(current).__name__) if current is not None else "a value"
      return f"--config.{key}={value!r}: {one_line(str(error).split(': ', 1)[-1])}; {key} takes {expected} (see --config_help)"
  return None


def config_flags_parser(argv: list[str]) -> list[str]:
  """A `flags_parser` for `app.run` in a command with a `--config` flag
  (`config_flags.DEFINE_config_file("config", ...)`): the checks above, then absl's parsing."""
  arguments = argv[1:]
  try:
    if any(a in HELP_FLAGS for a in arguments):
      return flags.FLAGS(argv)
    path = config_argument(arguments)
    if not path:
      raise UsageError(
        "--config is required: pass --config=FILE, a config file such as configs/tiny.py "
        "(every file in configs/ is one)"
      )
    config = load_config_file(path)
    try:
      return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError) as e:
      explained = _explain_override(e, arguments, config)
      if explained is None and not isinstance(e, flags.Error):
        raise
      raise UsageError(explained or explain_flag_error(e)) from e
  except UsageError as e:
    exit_with_error(e, arguments)


def workdir_problem(workdir: str) -> str | None:
  """Why `workdir` cannot be a training workdir (an existing file, or a parent that is a
  file or not writable), else None."""
  if os.path.exists(workdir):
    if not os.path.isdir(workdir):
      return f"--workdir={workdir} is a file; pass a directory (new, or holding a run to resume)"
    if not os.access(workdir, os.W_OK | os.X_OK):
      return f"--workdir={workdir} is not writable by this user; pass another directory"
    return None
  parent = os.path.dirname(os.path.abspath(workdir))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    return f"--workdir={workdir} cannot be created: {parent} is a file"
  if not os.access(parent, os.W_OK | os.X_OK):
    return f"--workdir={workdir} cannot be created: {parent} is not writable by this user"
  return None
