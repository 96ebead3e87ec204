#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs castle_jax (editable) with its test extra.
# Idempotent: re-running only reinstalls when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

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

stamp=.venv/.castle_jax_installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup.sh: installing castle_jax and its dependencies into .venv" >&2
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install --quiet --upgrade pip
  PIP_DISABLE_PIP_VERSION_CHECK=1 .venv/bin/python -m pip install --quiet -e ".[test]"
  echo "$want" > "$stamp"
fi
