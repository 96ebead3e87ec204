"""scripts/setup.sh installs the package with its test extra, or without it (`--train`),
and installs again only when pyproject.toml changed or the extra is missing. A stand-in
for .venv/bin/python records the pip commands instead of running them."""

import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAKE_PYTHON = """#!/usr/bin/env bash
# Answers the Python 3.12 check; records every other call.
if [ "$1" = "-c" ]; then exit 0; fi
echo "$*" >> "$(dirname "$0")/../calls.log"
"""


def _checkout(tmp_path):
  (tmp_path / "scripts").mkdir()
  shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), tmp_path / "scripts")
  shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
  python = tmp_path / ".venv" / "bin" / "python"
  python.parent.mkdir(parents=True)
  python.write_text(FAKE_PYTHON)
  python.chmod(0o755)
  return tmp_path


def _setup(checkout, *args):
  done = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=checkout, capture_output=True, text=True, timeout=60)
  log = checkout / ".venv" / "calls.log"
  calls = [line for line in log.read_text().splitlines() if "install --quiet -e" in line] if log.exists() else []
  if log.exists():
    log.unlink()
  return done, calls


def test_setup_installs_only_what_is_missing(tmp_path):
  checkout = _checkout(tmp_path)
  done, calls = _setup(checkout, "--train")
  assert done.returncode == 0 and calls == ["-m pip install --quiet -e ."], done.stderr
  assert done.stderr.splitlines() == ["setup.sh: installing castle_jax and its dependencies into .venv"]
  assert _setup(checkout, "--train")[1] == []  # nothing changed
  assert _setup(checkout)[1] == ["-m pip install --quiet -e .[test]"]  # the test extra is missing
  assert _setup(checkout)[1] == [] and _setup(checkout, "--train")[1] == []  # "test" covers --train
  with open(checkout / "pyproject.toml", "a") as f:
    f.write("\n# changed\n")
  assert _setup(checkout, "--train")[1] == ["-m pip install --quiet -e ."]


def test_a_bad_argument_is_one_line(tmp_path):
  done, calls = _setup(_checkout(tmp_path), "--trian")
  assert done.returncode == 1 and calls == []
  assert done.stderr.strip().splitlines() == [
    "ERROR: setup.sh: unknown argument '--trian'; pass --train (without the test extra) or nothing"
  ]
