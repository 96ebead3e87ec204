#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs castle_jax (editable) with its test extra
# (pytest, ruff, the notebook runner); `--train`: without it, for training, sampling and
# evaluation only. Idempotent: re-running installs only what pyproject.toml changed or
# what the extra adds.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="test"
for argument in "$@"; do
  case "$argument" in
    --train) extras="" ;;
    -h | --help)
      echo "usage: bash scripts/setup.sh [--train]   (--train: without the test extra)"
      exit 0
      ;;
    *)
      echo "ERROR: setup.sh: unknown argument '$argument'; pass --train (without the test extra) or nothing" >&2
      exit 1
      ;;
  esac
done

is_python312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; }

find_python312() {
  local candidate
  for candidate in python3.12 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1 && is_python312 "$candidate"; then
      command -v "$candidate"; return 0
    fi
  done
  local pyenv_root="${PYENV_ROOT:-$HOME/.pyenv}"
  for candidate in $(ls -d "$pyenv_root"/versions/3.12*/bin/python3 2>/dev/null | sort -V -r); do
    if is_python312 "$candidate"; then echo "$candidate"; return 0; fi
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_python312 .venv/bin/python; then
  if ! PYTHON=$(find_python312); then
    echo "setup.sh: no Python 3.12 found (looked on PATH for python3.12/python3/python, then in ${PYENV_ROOT:-$HOME/.pyenv}/versions/3.12*)." >&2
    echo "setup.sh: jax 0.11.2 needs Python 3.12; install it (e.g. 'pyenv install 3.12') and re-run." >&2
    exit 1
  fi
  echo "setup.sh: creating .venv with $PYTHON" >&2
  rm -rf .venv
  "$PYTHON" -m venv .venv
fi

# The stamp records pyproject.toml's hash and the extra installed ("test" covers --train).
stamp=.venv/.castle_jax_installed
hash="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ -f "$stamp" ]; then read -r installed_hash installed_extras < "$stamp" || true; fi
if [ "${installed_hash:-}" != "$hash" ] || { [ -n "$extras" ] && [ "${installed_extras:-}" != "$extras" ]; }; then
  echo "setup.sh: installing castle_jax${extras:+ with its $extras extra} and its dependencies into .venv" >&2
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install --quiet --upgrade pip
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
  echo "$hash $extras" > "$stamp"
fi
