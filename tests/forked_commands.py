"""Runs many `python ARGS...` command lines the way Python runs them, each in a process
forked from this one once it has imported the large third-party packages they share
(jax, flax, orbax, grain, TensorFlow Datasets, ...): a fresh interpreter per command
would spend seconds importing those again. Nothing of this repository is imported
before the fork, so each command imports its own code as it would when run alone.

    python tests/forked_commands.py < commands.json > results.json

or `run(commands, cwd, env)` from a test. Reads a JSON list of argument lists
(`["-m", "train", "--bogus"]` or `["colabs/execute.py", ...]`, run from the working
directory) and writes a JSON list of {"returncode", "stdout", "stderr"}, one per command,
running two at a time. In each child, stdout and stderr are files at the descriptor level
(as for a subprocess), a `-m` module runs as `__main__` with the working directory first
on sys.path, a script with its folder first; an uncaught exception prints its traceback
and exits 1, and the atexit handlers run, as in an interpreter's exit.

This process's own stderr gets whatever the imports before the fork print (a warning
of a package on import): a caller that counts the lines a command prints on stderr
must require it to be empty, since a command run alone would print them too.
"""

import atexit
import json
import os
import runpy
import shutil
import sys
import tempfile

PRELOADED = (
  "numpy",
  "jax",
  "jax.numpy",
  "jax.experimental.pallas",
  "jax.experimental.pallas.mosaic_gpu",
  "jax.experimental.pallas.triton",
  "flax.linen",
  "optax",
  "orbax.checkpoint",
  "grain",
  "ml_collections",
  "absl.flags",
  "absl.logging",
  "tensorflow_datasets",
  "safetensors",
  "tokenizers",
  "nbformat",
  "nbclient",
)
PARALLEL = 2


def _run_in_child(args: list[str]) -> int:
  """Runs one command line in this (forked) process; returns its exit status."""
  try:
    if args[0] == "-m":
      sys.argv = ["-m", *args[2:]]
      sys.path[0] = os.getcwd()
      runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = list(args)
      sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
      runpy.run_path(args[0], run_name="__main__")
    code = 0
  except SystemExit as e:
    if e.code is None or isinstance(e.code, int):
      code = e.code or 0
    else:
      print(e.code, file=sys.stderr)
      code = 1
  except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
    sys.excepthook(*sys.exc_info())
    code = 1
  atexit._run_exitfuncs()
  return code


def _start(args: list[str], out_dir: str, number: int) -> int:
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid:
    return pid
  code = 1
  try:
    for fd, name in ((1, "stdout"), (2, "stderr")):
      target = os.open(os.path.join(out_dir, f"{number}.{name}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
      os.dup2(target, fd)
      os.close(target)
    code = _run_in_child(args)
  finally:
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(code)


def run_all(commands: list[list[str]]) -> list[dict]:
  results = [None] * len(commands)
  # Not a TemporaryDirectory: its finalizer, an atexit handler, would run in the children.
  out_dir = tempfile.mkdtemp()
  try:
    running = {}
    pending = list(enumerate(commands))
    while pending or running:
      while pending and len(running) < PARALLEL:
        number, args = pending.pop(0)
        running[_start(args, out_dir, number)] = number
      pid, status = os.wait()
      number = running.pop(pid)
      output = {}
      for name in ("stdout", "stderr"):
        with open(os.path.join(out_dir, f"{number}.{name}"), errors="replace") as f:
          output[name] = f.read()
      results[number] = {"returncode": os.waitstatus_to_exitcode(status), **output}
  finally:
    shutil.rmtree(out_dir)
  return results


def run(commands: list[list[str]], cwd: str, env: dict[str, str], timeout: float = 600):
  """(a CompletedProcess for each `python *command`, what the imports before the fork
  printed on stderr), running this file as a subprocess."""
  import subprocess

  runner = subprocess.run(
    [sys.executable, os.path.abspath(__file__)],
    input=json.dumps(commands),
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  if runner.returncode:
    raise RuntimeError(f"{__file__} failed (exit {runner.returncode}):\n{runner.stderr[-3000:]}")
  results = json.loads(runner.stdout)
  return [subprocess.CompletedProcess([sys.executable, *c], **r) for c, r in zip(commands, results)], runner.stderr


def main() -> None:
  commands = json.load(sys.stdin)
  for name in PRELOADED:
    __import__(name)
  json.dump(run_all(commands), sys.stdout)


if __name__ == "__main__":
  main()
