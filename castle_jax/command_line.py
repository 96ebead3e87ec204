"""What every command shares: a bad argument ends in one line `ERROR: ...` that names the
argument, the bad value and the fix, with exit status 1; `--traceback` shows the full
traceback instead.

argparse commands:

    def main(argv):
      parser = command_line.ArgumentParser(description=__doc__)
      parser.add_argument("--iters", type=command_line.positive_int, default=10)
      args = parser.parse_args(argv)
      ...

    if __name__ == "__main__":
      sys.exit(command_line.run(main))

absl commands: `command_line.run_absl(main)` instead of `app.run(main)`.

This module imports nothing heavy (no jax), so that a command can check its arguments
before it pays for its imports.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Callable, NoReturn, Sequence

from absl import app, flags

TRACEBACK_HELP = "show the full traceback of an error instead of one line"
EXIT_ERROR = 1
DTYPES = ("bfloat16", "float32", "float16")


class UsageError(Exception):
  """A bad argument or input; the message names it, the bad value and the fix."""


def one_line(message: object) -> str:
  """`message` as one line (line breaks and runs of spaces become single spaces)."""
  return " ".join(str(message).split())


def wants_traceback(argv: Sequence[str]) -> bool:
  """Whether the arguments ask for full tracebacks (`--traceback`, `--traceback=true`)."""
  for argument in argv:
    if argument == "--traceback":
      return True
    if argument.startswith("--traceback="):
      return argument.split("=", 1)[1].lower() in ("1", "true", "yes")
  return False


def print_error(message: object) -> None:
  print(f"ERROR: {one_line(message)}", file=sys.stderr, flush=True)


def exit_with_error(error: BaseException, argv: Sequence[str] | None = None) -> NoReturn:
  """Ends the command on `error`: one ERROR line and exit status 1, or, with --traceback in
  `argv` (default: the process's arguments), the error raised again with its traceback."""
  if wants_traceback(sys.argv[1:] if argv is None else argv):
    raise error
  print_error(error)
  sys.exit(EXIT_ERROR)


def run(
  main: Callable[[list[str]], object],
  argv: Sequence[str] | None = None,
  *,
  errors: tuple[type[BaseException], ...] = (UsageError,),
) -> int:
  """Calls `main(argv)` (argv without the program name; default the process's) and returns
  its exit status: main's own if it returns an int, else 0; 1 after one ERROR line for an
  exception of `errors` (raised again with --traceback)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    status = main(argv)
  except errors as e:
    if wants_traceback(argv):
      raise
    print_error(e)
    return EXIT_ERROR
  return status if isinstance(status, int) else 0


# --- argparse --------------------------------------------------------------------------------------

_INVALID_VALUE = re.compile(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: '(.*)'$")
_EXPECTED = {"int": "an integer", "float": "a number"}


class ArgumentParser(argparse.ArgumentParser):
  """argparse with `--traceback`, whose usage errors are one `ERROR: ...` line (a UsageError
  that `run` prints) instead of the usage text and exit status 2."""

  def __init__(self, *args, **kwargs):
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    super().__init__(*args, **kwargs)
    self.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)

  def error(self, message: str) -> NoReturn:
    invalid = _INVALID_VALUE.match(message)
    if invalid and invalid.group(2) in _EXPECTED:
      flag, kind, value = invalid.groups()
      message = f"{flag}={value!r} is not {_EXPECTED[kind]}"
    raise UsageError(f"{message} (see --help)")


def _integer(text: str, minimum: int, rule: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < minimum:
    raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
  return value


def positive_int(text: str) -> int:
  """argparse type: an integer >= 1."""
  return _integer(text, 1, "an integer >= 1")


def nonnegative_int(text: str) -> int:
  """argparse type: an integer >= 0."""
  return _integer(text, 0, "an integer >= 0")


def new_file(text: str) -> str:
  """argparse type: a path where nothing exists yet (results are never replaced)."""
  if os.path.lexists(text):
    raise argparse.ArgumentTypeError(
      f"{text!r} exists (results of an earlier run are never replaced); pass a new name, or move it away first"
    )
  return text


def _int_list(text: str, minimum: int) -> list[int]:
  parts = [part.strip() for part in text.split(",") if part.strip()]
  try:
    values = [int(part) for part in parts]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1024,4096") from None
  if not values:
    raise argparse.ArgumentTypeError(f"{text!r} lists no integer, e.g. 1024,4096")
  if min(values) < minimum:
    raise argparse.ArgumentTypeError(f"{text!r} must list integers >= {minimum}")
  return values


def positive_int_list(text: str) -> list[int]:
  """argparse type: '1024,4096' -> [1024, 4096], each >= 1."""
  return _int_list(text, 1)


def optional_positive_int_list(text: str) -> list[int]:
  """argparse type: like `positive_int_list`, and '' -> [] (the default of an optional list)."""
  return _int_list(text, 1) if text.strip() else []


def number_list(text: str) -> list[float]:
  """argparse type: '0,0.5' -> [0.0, 0.5]."""
  try:
    values = [float(part) for part in text.split(",") if part.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, e.g. 0,1") from None
  if not values:
    raise argparse.ArgumentTypeError(f"{text!r} lists no number, e.g. 0,1")
  return values


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
  """argparse type: a comma-separated list of some of `choices`."""

  def parse(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [v for v in values if v not in choices]
    if unknown:
      raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}")
    return values

  return parse


def parsed_by(parse: Callable[[str], object], what: str) -> Callable[[str], object]:
  """argparse type: `parse(text)`, whose ValueError/TypeError says what is wrong, e.g. a
  kernel config string (`CastleKernelConfig.from_string`); `what` names the expected form."""

  def convert(text: str) -> object:
    try:
      return parse(text)
    except (ValueError, TypeError, KeyError) as e:
      raise argparse.ArgumentTypeError(f"{text!r} is not {what}: {one_line(e)}") from None

  return convert


def validated_by(parse: Callable[[str], object], what: str) -> Callable[[str], str]:
  """argparse type: the text itself, once `parse(text)` accepted it (see `parsed_by`)."""
  check = parsed_by(parse, what)

  def convert(text: str) -> str:
    check(text)
    return text

  return convert


# --- absl ------------------------------------------------------------------------------------------


def explain_flag_error(error: Exception, flag_values=flags.FLAGS) -> str:
  """absl's message for a bad flag, with the fix: the flag's form, or the nearest known flag
  (among the names `flag_values` iterates over)."""
  message = str(error)
  unknown = re.match(r"Unknown command line flag '([^']+)'", message)
  if unknown:
    name = unknown.group(1)
    close = difflib.get_close_matches(name, list(flag_values), n=1)
    hint = f"; did you mean --{close[0]}?" if close else ""
    return f"unknown flag --{name}{hint} (see --help)"
  if message.startswith("flag --"):
    message = message[len("flag ") :]
  # A list flag's value as typed: absl shows the parsed list (`--tree=['4', 'x']`).
  as_typed = lambda match: f"{match.group(1)}={re.sub(r"['\s]", "", match.group(2))}:"
  message = re.sub(r"^(--\w+)=\[(.*?)\]:", as_typed, message)
  return f"{message} (see --help)"


def absl_flags_parser(argv: list[str]) -> list[str]:
  """A `flags_parser` for `app.run`: absl's flag parsing, with a bad flag as one ERROR line
  and exit status 1 (absl prints two lines and the usage)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    exit_with_error(UsageError(explain_flag_error(e)), argv[1:])


def own_flags_parser(command_flags: flags.FlagValues) -> Callable[[list[str]], list[str]]:
  """A `flags_parser` for `run_absl` for a command whose flags live in `command_flags`, not in
  absl's global FLAGS: other commands define flags of the same names (--step, --output), and a
  test process imports several. Parses the command's flags, then absl's own (--verbosity,
  --traceback) from what is left; a bad flag is one ERROR line; --help lists the command's flags."""

  def parse(argv: list[str]) -> list[str]:
    if any(arg in ("-h", "--help", "--helpshort", "--helpfull") for arg in argv[1:]):
      print(command_flags.get_help(), flush=True)
      sys.exit(0)
    try:
      rest = command_flags(argv, known_only=True)
      return flags.FLAGS(rest)
    except flags.Error as e:
      exit_with_error(UsageError(explain_flag_error(e, [*command_flags, *flags.FLAGS])), argv[1:])

  return parse


def run_absl(
  main: Callable[[list[str]], object],
  *,
  errors: tuple[type[BaseException], ...] = (UsageError,),
  flags_parser: Callable[[list[str]], list[str]] = absl_flags_parser,
) -> None:
  """`app.run(main)` with `--traceback`, bad flags and exceptions of `errors` as one ERROR
  line (exit status 1), and leftover positional arguments refused."""
  if "traceback" not in flags.FLAGS:
    flags.DEFINE_bool("traceback", False, TRACEBACK_HELP)

  def checked_main(argv: list[str]):
    try:
      if len(argv) > 1:
        raise UsageError(
          f"unexpected argument(s) {' '.join(argv[1:])!r}: flags take the form --name=value (see --help)"
        )
      return main(argv)
    except errors as e:
      exit_with_error(e)

  app.run(checked_main, flags_parser=flags_parser)
