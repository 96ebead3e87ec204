"""Executes the notebooks in colabs/ top to bottom and saves them with their outputs.

    .venv/bin/python colabs/execute.py                      # every colabs/*.ipynb
    .venv/bin/python colabs/execute.py colabs/power_attention.ipynb [--timeout=600]
    .venv/bin/python colabs/execute.py --in_place           # refresh the committed notebooks

The executed copies go to a new folder under ~/.cache/castle_jax/notebooks/ (or
--output_dir); the committed notebooks, which carry their outputs so that plots show
without running anything, are rewritten only with --in_place: run that after editing a
notebook (or the code it shows) to refresh them.
Each notebook runs in a fresh kernel of the interpreter running this script, with the
notebook's folder as working directory and this checkout first on PYTHONPATH (so it
shows this checkout's code whatever else is installed), on the backend that jax
finds: on a CPU machine the GPU sections print that they were skipped.

`tests/test_notebooks.py` runs the same `execute_notebook` on in-memory copies.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

from castle_jax.command_line import ArgumentParser, UsageError, positive_int, run
from castle_jax.outputs import fresh_directory, refuse_existing, user_cache_dir

COLABS_DIR = pathlib.Path(__file__).resolve().parent
REPOSITORY_ROOT = COLABS_DIR.parent
DEFAULT_TIMEOUT_S = 600  # per cell
KERNEL_NAME = "castle-jax-current-python"


def notebook_paths() -> list[pathlib.Path]:
  return sorted(COLABS_DIR.glob("*.ipynb"))


def kernel_environment() -> dict[str, str]:
  """The kernel's environment: this one, with the checkout first on PYTHONPATH, matplotlib's
  inline backend (a non-interactive MPLBACKEND such as Agg would drop every figure) and
  without a forced CPU device count (a test process sets one for its own sharding tests;
  the notebooks run on the devices a user has)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPOSITORY_ROOT), env.get("PYTHONPATH")]))
  env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
  xla_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
  if xla_flags:
    env["XLA_FLAGS"] = xla_flags
  else:
    env.pop("XLA_FLAGS", None)
  return env


def _kernel_manager(spec_root: pathlib.Path) -> AsyncKernelManager:
  """A manager of an ipykernel of this very interpreter, not of whatever 'python3' kernel
  a Jupyter installation on the machine points to."""
  kernel_dir = spec_root / KERNEL_NAME
  kernel_dir.mkdir(parents=True)
  spec = {
    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
    "display_name": "Python 3",
    "language": "python",
  }
  (kernel_dir / "kernel.json").write_text(json.dumps(spec))
  # IPC sockets (files in the spec folder) rather than TCP ports on localhost: nothing to
  # collide with when tests run notebooks in parallel, and no unencrypted-TCP warning.
  return AsyncKernelManager(
    kernel_name=KERNEL_NAME,
    kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec_root)]),
    transport="ipc",
    ip=str(spec_root / "kernel"),
  )


def execute_notebook(
  notebook: nbformat.NotebookNode, *, working_dir: pathlib.Path, timeout_s: int = DEFAULT_TIMEOUT_S
) -> nbformat.NotebookNode:
  """Runs every cell of `notebook` in place (outputs replaced) in a fresh kernel started in
  `working_dir`, and shuts the kernel down.

  Raises:
    nbclient.exceptions.CellExecutionError: a cell raised; the message shows the cell and
      its traceback.
    nbclient.exceptions.CellTimeoutError: a cell ran longer than `timeout_s`.
  """
  with tempfile.TemporaryDirectory() as spec_root:
    # No per-cell timestamps in the saved metadata: a refresh then changes only what the cells print.
    client = NotebookClient(
      notebook,
      km=_kernel_manager(pathlib.Path(spec_root)),
      timeout=timeout_s,
      record_timing=False,
      resources={"metadata": {"path": str(working_dir)}},
    )
    client.execute(cleanup_kc=True, env=kernel_environment())
  return notebook


def _notebook(text: str) -> pathlib.Path:
  """argparse type: an existing .ipynb file."""
  path = pathlib.Path(text)
  if path.suffix != ".ipynb":
    raise argparse.ArgumentTypeError(f"{text!r} is not a notebook (.ipynb)")
  if not path.is_file():
    close = sorted(p.name for p in notebook_paths() if p.stem.startswith(path.stem[:4]))
    hint = f"; colabs/ has {', '.join(close)}" if close else f"; colabs/ has {len(notebook_paths())} notebooks"
    raise argparse.ArgumentTypeError(f"{text!r}: no such file{hint}")
  return path.resolve()


def _cell_error(path: pathlib.Path, error: Exception) -> UsageError:
  """A failed cell as one line: the notebook and the cell's exception (--traceback: all of it)."""
  if isinstance(error, CellTimeoutError):
    return UsageError(f"{path.name}: a cell ran longer than --timeout: {str(error).splitlines()[0]}")
  return UsageError(f"{path.name}: a cell raised {error.ename}: {error.evalue} (--traceback shows the cell)")


def main(argv: list[str]) -> None:
  parser = ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("notebooks", nargs="*", type=_notebook, help="default: every colabs/*.ipynb")
  parser.add_argument("--timeout", type=positive_int, default=DEFAULT_TIMEOUT_S, help="seconds per cell")
  where = parser.add_mutually_exclusive_group()
  where.add_argument(
    "--output_dir",
    default=None,
    help=f"where the executed notebooks go (none of them may exist there); default: a new folder under "
    f"{user_cache_dir('notebooks')}",
  )
  where.add_argument(
    "--in_place", action="store_true", help="rewrite the notebooks themselves (refreshes the committed outputs)"
  )
  args = parser.parse_args(argv)
  paths = args.notebooks or notebook_paths()
  if args.in_place:
    destination = None
  elif args.output_dir:
    refuse_existing(f"--output_dir={args.output_dir}", *(os.path.join(args.output_dir, p.name) for p in paths))
    os.makedirs(args.output_dir, exist_ok=True)
    destination = pathlib.Path(args.output_dir)
  else:
    destination = pathlib.Path(fresh_directory(user_cache_dir("notebooks")))
  for path in paths:
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    try:
      execute_notebook(notebook, working_dir=path.parent, timeout_s=args.timeout)
    except (CellExecutionError, CellTimeoutError) as e:
      raise _cell_error(path, e) from e
    written = path if destination is None else destination / path.name
    nbformat.write(notebook, written)
    print(f"{path}: executed in {time.perf_counter() - start:.1f} s -> {written}", flush=True)


if __name__ == "__main__":
  sys.exit(run(main))
