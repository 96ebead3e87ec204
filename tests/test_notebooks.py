"""Every notebook in colabs/ executes top to bottom without a cell error.

Each notebook runs on an in-memory copy (the committed file and its outputs stay as
they are) in a fresh kernel of this interpreter, through the same `execute_notebook`
that `colabs/execute.py` uses to refresh the committed outputs. A new notebook in
colabs/ is picked up by the glob. On a CPU the notebooks' GPU sections print that
they were skipped; everything else runs.
"""

import importlib.util
import pathlib
import re

import nbformat
import pytest

REPOSITORY_ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPOSITORY_ROOT / "colabs").glob("*.ipynb"))
# Per cell; a notebook takes about a minute on a 2-core CPU.
TIMEOUT_S = 600


def _execute_module():
  spec = importlib.util.spec_from_file_location("colabs_execute", REPOSITORY_ROOT / "colabs" / "execute.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_there_are_notebooks():
  assert NOTEBOOKS, "no notebooks found in colabs/"


# The heaviest notebooks run with -m slow (and on the GPU); the default suite keeps the
# training quick start and the GCA retrieval notebook.
SLOW_NOTEBOOKS = ("longspec", "castle_kernels", "castle_lookahead_keys", "power_attention")


# Shorter runs where a long one only repeats what a short one executes (the committed
# outputs show the full runs): values for names that the notebook's cell tagged
# "parameters" assigns, set in a cell inserted after it (papermill's convention).
TEST_PARAMETERS = {
  "train_and_sample": {"STEPS": 10, "CASTLE_STEPS": 5},
  "gca_retrieval": {"LONG_PROMPT_TOKENS": 2_048},
}


def _with_parameters(notebook: nbformat.NotebookNode, values: dict) -> nbformat.NotebookNode:
  """`notebook` with a cell assigning `values` after its cell tagged "parameters", which must
  assign every name in `values` (so an override cannot miss silently)."""
  tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
  assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
  assigned = set(re.findall(r"^(\w+)\s*=", notebook.cells[tagged[0]].source, re.MULTILINE))
  missing = sorted(set(values) - assigned)
  assert not missing, f"the parameters cell assigns {sorted(assigned)}, not {missing}"
  notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in values.items())))
  return notebook


@pytest.mark.parametrize(
  "path",
  [pytest.param(path, marks=pytest.mark.slow) if path.stem in SLOW_NOTEBOOKS else path for path in NOTEBOOKS],
  ids=[path.stem for path in NOTEBOOKS],
)
def test_notebook_executes(path):
  notebook = nbformat.read(path, as_version=4)
  committed = path.read_bytes()
  if path.stem in TEST_PARAMETERS:
    notebook = _with_parameters(notebook, TEST_PARAMETERS[path.stem])
  # Raises CellExecutionError, naming the cell and showing its traceback, on any error.
  executed = _execute_module().execute_notebook(notebook, working_dir=path.parent, timeout_s=TIMEOUT_S)
  code_cells = [cell for cell in executed.cells if cell.cell_type == "code"]
  assert code_cells and all(cell.get("execution_count") for cell in code_cells), "a code cell did not run"
  assert path.read_bytes() == committed, f"executing {path.name} changed the committed file"


def _tiny_notebook(path: pathlib.Path, source: str) -> pathlib.Path:
  nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]), path)
  return path


def _printed(path: pathlib.Path) -> str:
  return "".join(output.get("text", "") for output in nbformat.read(path, as_version=4).cells[0].outputs)


def test_the_runner_writes_elsewhere_unless_asked_to_refresh_in_place(tmp_path, monkeypatch, capsys):
  execute = _execute_module()
  notebook = _tiny_notebook(tmp_path / "tiny.ipynb", "print(6 * 7)")
  committed = notebook.read_bytes()
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

  execute.main([str(notebook)])  # default: a new folder in the user's cache
  (run,) = (tmp_path / "cache" / "castle_jax" / "notebooks").iterdir()
  assert _printed(run / "tiny.ipynb") == "42\n" and notebook.read_bytes() == committed

  execute.main([str(notebook), f"--output_dir={tmp_path / 'out'}"])
  assert _printed(tmp_path / "out" / "tiny.ipynb") == "42\n" and notebook.read_bytes() == committed
  assert execute.run(execute.main, [str(notebook), f"--output_dir={tmp_path / 'out'}"]) == 1  # never replaced
  assert "tiny.ipynb exists (results of an earlier run are never replaced)" in capsys.readouterr().err

  execute.main([str(notebook), "--in_place"])
  assert _printed(notebook) == "42\n"

  broken = _tiny_notebook(tmp_path / "broken.ipynb", "raise ValueError('no such table')")
  assert execute.run(execute.main, [str(broken)]) == 1
  assert capsys.readouterr().err.strip() == (
    "ERROR: broken.ipynb: a cell raised ValueError: no such table (--traceback shows the cell)"
  )
