"""The commands shown in the user docs (README.md and docs/*.md) name things that exist.

For every command line in a ```bash, ```sh, ```console or plain fenced block:

- `python -m MODULE` (also `.venv/bin/python`, `python3`) names a module of this repository
  that can be run (a module outside it, such as pytest, must be installed; pytest's file
  arguments must exist, its flags are not checked); `python PATH.py`, `bash PATH` and
  `scripts/...` name files that exist.
- Every `--flag` after a module of this repository is one that the module accepts: it is in
  the module's `--help` output (argparse) or `--helpfull` output (absl), run once per module
  as a subprocess from the repository root. `--config.KEY=VALUE` must name a key of the
  config file given by `--config=FILE` on the same line, loaded and looked up as
  `python -m train` does (train/command_line.py); without a file, a key of
  train/config.py's `base_config()`.
- Every `configs/NAME.py` written anywhere in those files exists.

Placeholders are skipped: `<...>`, `...`, `$VARS` (except variables assigned earlier in the
same block, which are expanded), and the `[ ]`, `( )` and `|` of optional or alternative
arguments. Every problem found is listed, with its file and line, in one failure.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
from typing import NamedTuple

import forked_commands
from castle_jax.command_line import UsageError
from train.command_line import _explain_override, config_argument, load_config_file
from train.config import base_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_CONFIG_FILE = re.compile(r"(?<![\w./-])configs/(\w+)\.py\b")
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")
_PYTHON = re.compile(r"(?:.*/)?python(?:\d+(?:\.\d+)?)?")
_SEPARATORS = ("&&", "||", ";")
_HELP_TIMEOUT_S = 300  # all the modules' help


class Command(NamedTuple):
  """`python -m module args...` as written at `where` (file:line); `lines` are its
  physical lines, numbered, to point a problem at the line that holds it."""

  where: str
  lines: tuple[tuple[int, str], ...]
  module: str
  args: tuple[str, ...]


def _is_placeholder(text: str) -> bool:
  return any(mark in text for mark in ("<", ">", "...", "$", "*", "{"))


def _unwrap(token: str) -> str:
  """`[--flag=x]` or `(--flag` -> `--flag=x`: the brackets of optional or grouped arguments."""
  return token.lstrip("[(").rstrip("])")


def _shell_lines(name: str, text: str):
  """(block id, [(line number, physical line), ...]) of each command line in the shell
  blocks of a markdown file, backslash-continued lines joined."""
  block, language, pending = None, "", []
  for number, line in enumerate(text.splitlines(), 1):
    fence = _FENCE.match(line)
    if fence:
      block, language = (None, "") if block is not None else (f"{name}:{number}", fence.group(2).lower())
      pending = []
      continue
    if block is None or language not in SHELL_BLOCKS:
      continue
    if language == "console" and not pending:
      if not line.lstrip().startswith("$ "):
        continue  # a command's output
      line = line.lstrip()[2:]
    pending.append((number, line))
    if not line.rstrip().endswith("\\"):
      yield block, pending
      pending = []


def _tokens(text: str) -> list[str]:
  try:
    return shlex.split(text, comments=True)
  except ValueError:  # an unbalanced quote in a plain block of prose
    return text.split("#")[0].split()


def _segments(tokens: list[str]) -> list[list[str]]:
  """The commands of one line, split at `&&`, `||` and `;`."""
  segments, current = [], []
  for token in tokens:
    if token in _SEPARATORS:
      segments.append(current)
      current = []
    elif token.endswith(";"):
      current.append(token[:-1])
      segments.append(current)
      current = []
    else:
      current.append(token)
  return [s for s in [*segments, current] if s]


def _expand(tokens: list[str], variables: dict[str, tuple[str, list]]) -> tuple[list[str], list]:
  """`tokens` with the block's variables expanded, and the lines that assigned them."""
  expanded, lines = [], []
  for token in tokens:
    match = _VARIABLE.fullmatch(token)
    name = match and (match.group(1) or match.group(2))
    if name in variables:
      value, assigned = variables[name]
      expanded.extend(_tokens(value))
      lines.extend(assigned)
    else:
      expanded.append(token)
  return expanded, lines


def _module_file(module: str) -> pathlib.Path | None:
  """The file `python -m module` runs, if it is in this repository."""
  path = ROOT.joinpath(*module.split("."))
  for candidate in (path.parent / f"{path.name}.py", path / "__main__.py"):
    if candidate.is_file():
      return candidate
  return None


def _is_external(module: str) -> bool:
  """Whether `module` is installed from outside this repository (pytest, pip)."""
  top = module.split(".")[0]
  if (ROOT / top).exists() or (ROOT / f"{top}.py").exists():
    return False
  return importlib.util.find_spec(top) is not None  # a top-level name: nothing is imported


def _missing_file(path: str, where: str) -> list[str]:
  if _is_placeholder(path) or (ROOT / path).exists():
    return []
  return [f"{where}: {path}: no such file"]


def find_commands(name: str, text: str) -> tuple[list[Command], list[str]]:
  """The `python -m` commands of this repository in markdown `text`, and the problems
  found without running anything (missing modules, scripts and config files)."""
  commands, problems = [], []
  for number, line in enumerate(text.splitlines(), 1):
    for config in _CONFIG_FILE.findall(line):
      if not (ROOT / "configs" / f"{config}.py").is_file():
        problems.append(f"{name}:{number}: configs/{config}.py: no such config file")
  variables: dict[str, dict[str, tuple[str, list]]] = {}
  for block, lines in _shell_lines(name, text):
    where = f"{name}:{lines[0][0]}"
    joined = " ".join(line.rstrip().removesuffix("\\") for _, line in lines)
    for segment in _segments(_tokens(joined)):
      if all(_ASSIGNMENT.match(token) for token in segment):  # NAME=value: used later as $NAME
        for token in segment:
          key, _, value = token.partition("=")
          variables.setdefault(block, {})[key] = (value, lines)
        continue
      while segment and _ASSIGNMENT.match(segment[0]):  # NAME=value command: the command's environment
        segment = segment[1:]
      segment, assigned = _expand(segment, variables.get(block, {}))
      for index, token in enumerate(segment):
        if _PYTHON.fullmatch(token):
          command, found = _python_command(where, (*assigned, *lines), segment[index + 1 :])
          problems.extend(found)
          commands.extend(command)
          break
        if token in ("bash", "sh") and index + 1 < len(segment):
          problems.extend(_missing_file(segment[index + 1], where))
          break
        if token.removeprefix("./").startswith("scripts/") and index == 0:
          problems.extend(_missing_file(token.removeprefix("./"), where))
          break
  return commands, problems


def _python_command(where, lines, args) -> tuple[list[Command], list[str]]:
  for index, arg in enumerate(args):
    if arg == "-m" and index + 1 < len(args):
      module = args[index + 1].rstrip(":;,")
      rest = tuple(args[index + 2 :])
      if _is_placeholder(module):
        return [], []
      if _module_file(module):
        return [Command(where, lines, module, rest)], []
      if _is_external(module):
        if module == "pytest":
          paths = [a for a in map(_unwrap, rest) if not a.startswith("-") and ("/" in a or a.endswith(".py"))]
          return [], [p for path in paths for p in _missing_file(path.split("::")[0], where)]
        return [], []
      return [], [f"{where}: python -m {module}: no such module in the repository (nor installed)"]
    if arg.endswith(".py"):
      return [], _missing_file(arg, where)
    if not arg.startswith("-"):
      return [], []
  return [], []


def _uses_absl(module: str) -> bool:
  source = _module_file(module).read_text(encoding="utf-8")
  return "run_absl(" in source or "app.run(" in source


def _help_flag(module: str) -> str:
  return "--helpfull" if _uses_absl(module) else "--help"


def _read_help(module: str, done: subprocess.CompletedProcess) -> tuple[frozenset[str] | None, str]:
  """(the flags `python -m module` accepts, by its help output `done`, or None; the help
  text or why it failed)."""
  flag = _help_flag(module)
  text = done.stdout + done.stderr
  if flag == "--helpfull":  # `  --flag: help` and `  --[no]flag: help`; absl exits 1 after printing it
    found = re.findall(r"^\s+--(\[no\])?([\w.-]+):", text, re.M)
    flags = {name for _, name in found} | {f"no{name}" for negated, name in found if negated}
  else:  # every option is in the usage block, which ends at the first blank line
    usage = text[text.find("usage:") :].split("\n\n")[0] if done.returncode == 0 and "usage:" in text else ""
    flags = set(re.findall(r"--([\w-]+)", usage))
  if not flags:
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"`python -m {module} {flag}` failed (exit {done.returncode}): {last}"
  return frozenset(flags), text


_help_cache: dict[str, tuple[frozenset[str] | None, str]] = {}


def _help(modules) -> dict[str, tuple[frozenset[str] | None, str]]:
  """The help of each module, each run once per test process, from the repository root,
  each in a process forked from one that has imported the large third-party packages
  (tests/forked_commands.py), two at a time."""
  todo = sorted(set(modules) - set(_help_cache))
  if todo:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", COLUMNS="200")
    commands = [["-m", module, _help_flag(module)] for module in todo]
    results, _ = forked_commands.run(commands, str(ROOT), env, timeout=_HELP_TIMEOUT_S)
    _help_cache.update((module, _read_help(module, done)) for module, done in zip(todo, results))
  return {module: _help_cache[module] for module in modules}


@functools.cache
def _config(path: str):
  """The config file at `path` (relative to the repository root) as `python -m train`
  loads it, or the one-line error it would print."""
  try:
    return load_config_file(str(ROOT / path)), None
  except UsageError as e:
    return None, str(e).replace(f"{ROOT}{os.sep}", "")


def _line_of(command: Command, text: str) -> str:
  """file:line of the physical line of `command` that holds the flag `text`."""
  name = command.where.rsplit(":", 1)[0]
  pattern = re.compile(rf"{re.escape(text)}(?![\w.-])")
  number = next((n for n, line in command.lines if pattern.search(line)), command.lines[0][0])
  return f"{name}:{number}"


def check_command(command: Command, flags: frozenset[str] | None, help_text: str) -> list[str]:
  """The flags of `command` that its module does not accept."""
  shown = f"python -m {command.module}"
  if flags is None:
    return [f"{command.where}: {help_text}"]
  args = [_unwrap(arg) for arg in command.args]
  problems = []
  config_path = config_argument(args) if "config" in flags else None
  for arg in args:
    if not arg.startswith("--") or arg == "--":
      continue
    name = arg[2:].split("=", 1)[0]
    if _is_placeholder(name):
      continue
    where = _line_of(command, f"--{name}")
    if not name.startswith("config."):
      if name not in flags:
        problems.append(f"{where}: {shown}: unknown flag --{name}")
      continue
    if "config" not in flags and "--config." not in help_text:
      problems.append(f"{where}: {shown}: takes no --config.KEY overrides (--{name})")
      continue
    if config_path is not None and _is_placeholder(config_path):
      continue
    config, error = _config(config_path) if config_path is not None else (base_config(), None)
    if error:
      problems.append(f"{_line_of(command, '--config')}: {shown}: {error}")
      break
    explained = _explain_override(Exception(), [arg], config)  # what `python -m train` says of an unknown key
    if explained:
      source = config_path or "train/config.py:base_config()"
      problems.append(f"{where}: {shown} (config {source}): {explained}")
  return problems


def check_markdown(docs: dict[str, str]) -> list[str]:
  """Every problem of the commands in `docs` ({file name: markdown text})."""
  problems, commands = [], []
  for name, text in docs.items():
    found, missing = find_commands(name, text)
    commands.extend(found)
    problems.extend(missing)
  helps = _help({c.module for c in commands})
  for command in commands:
    problems.extend(check_command(command, *helps[command.module]))
  return list(dict.fromkeys(problems))  # a variable's line, used by several commands, once


def test_doc_commands_are_valid():
  docs = {str(path.relative_to(ROOT)): path.read_text(encoding="utf-8") for path in DOCS}
  commands = [c for name, text in docs.items() for c in find_commands(name, text)[0]]
  assert len({c.module for c in commands}) >= 10, "the docs' commands were not found"
  problems = check_markdown(docs)
  assert not problems, f"{len(problems)} problems in the docs' commands:\n" + "\n".join(problems)


FAKE_DOC = """\
# A guide

```bash
.venv/bin/python -m train --config=configs/tiny.py --workdir=runs/x --config.train.steps=5 \\
    --config.train.no_such_key=1
python -m castle_jax.no_such_module --lengths=1024
python -m train --config=configs/tiny.py --no_such_flag [--config.<key>=<value> ...] --workdir=DIR
```

Train with `configs/no_such_config.py`.
"""


def test_checker_reports_each_kind_of_problem():
  problems = check_markdown({"fake.md": FAKE_DOC})
  expected = {
    "fake.md:5": "no key 'no_such_key'",
    "fake.md:6": "python -m castle_jax.no_such_module: no such module",
    "fake.md:7": "unknown flag --no_such_flag",
    "fake.md:10": "configs/no_such_config.py: no such config file",
  }
  assert len(problems) == len(expected), problems
  for where, message in expected.items():
    assert any(p.startswith(f"{where}: ") and message in p for p in problems), (where, message, problems)
