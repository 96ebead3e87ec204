"""The packages' import graph, read from the source with `ast` (nothing is imported):
  (a) pallas_kernels imports nothing from castle_jax or train (kernels depend on jax alone);
  (b) castle_jax imports nothing from train;
  (c) the module-level imports of castle_jax, pallas_kernels and train have no cycle;
  (d) no function-level imports of castle_jax or pallas_kernels remain.

Imports under `if TYPE_CHECKING:` never run and are left out: the layers and the
options classes name ModelConfig in annotations that way, because castle_jax.config
imports the attention table to check configs.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("castle_jax", "pallas_kernels", "train")


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _is_type_checking_block(node: ast.AST) -> bool:
  return isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
  """Full names of the modules (or module attributes) an import statement reads."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if node.level:  # relative: resolve against this module's package
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
  else:
    base = node.module
  return [f"{base}.{alias.name}" for alias in node.names] + [base]


def _parse_all():
  """{module: (module-level imports, function-level imports)} for every module of PACKAGES."""
  modules = {}
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      name = _module_name(path)
      tree = ast.parse(path.read_text(), str(path))
      top, nested = set(), set()

      def visit(node, in_function):
        if _is_type_checking_block(node):
          return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
          (nested if in_function else top).update(_imported_names(node, name, path.name == "__init__.py"))
        for child in ast.iter_child_nodes(node):
          visit(child, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

      visit(tree, False)
      modules[name] = (top, nested)
  return modules


MODULES = _parse_all()


def _internal(names: set[str]) -> set[str]:
  """The project modules among imported names (`from a.b import c` reads a.b.c if it is a module, else a.b)."""
  found = set()
  for name in names:
    while name and name not in MODULES:
      name = name.rpartition(".")[0]
    if name:
      found.add(name)
  return found


def _graph() -> dict[str, set[str]]:
  graph = {}
  for module, (top, _) in MODULES.items():
    edges = _internal(top) - {module}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first, except the packages that
    # contain the importing module: they are already being imported.
    own_packages = {module.rsplit(".", i)[0] for i in range(module.count(".") + 1)}
    for target in list(edges):
      parts = target.split(".")
      edges.update(".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES)
    graph[module] = edges - own_packages
  return graph


def test_the_parser_sees_the_packages():
  assert "castle_jax.ops.castle.api" in MODULES and "pallas_kernels.castle.triton" in MODULES
  assert "pallas_kernels.castle" in _graph()["castle_jax.ops.castle.api"]


@pytest.mark.parametrize(
  "package, forbidden", [("pallas_kernels", ("castle_jax", "train")), ("castle_jax", ("train",))]
)
def test_no_upward_imports(package, forbidden):
  bad = sorted(
    (module, target)
    for module, (top, nested) in MODULES.items()
    if module.split(".")[0] == package
    for target in _internal(top | nested)
    if target.split(".")[0] in forbidden
  )
  assert not bad, f"{package} must not import {forbidden}: {bad}"


def test_module_level_imports_have_no_cycle():
  graph = _graph()
  state = {}  # 1: on the current path, 2: done

  def visit(module, path):
    state[module] = 1
    for target in sorted(graph[module]):
      if state.get(target) == 1:
        cycle = path[path.index(target) :] + [target]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if target not in state:
        visit(target, path + [target])
    state[module] = 2

  for module in sorted(graph):
    if module not in state:
      visit(module, [module])


# Function-level imports of project modules that are allowed, with the reason: none.
ALLOWED_FUNCTION_LEVEL_IMPORTS: dict[str, str] = {}


def test_no_function_level_imports_of_the_library():
  found = sorted(
    (module, target)
    for module, (_, nested) in MODULES.items()
    for target in _internal(nested)
    if target.split(".")[0] in ("castle_jax", "pallas_kernels") and module not in ALLOWED_FUNCTION_LEVEL_IMPORTS
  )
  assert not found, f"import these at module top (or list them with a reason): {found}"


def test_no_module_only_re_exports_another():
  """A module that only imports names (an old path kept for existing imports) hides where
  the code lives: import from the real module instead."""
  shims = []
  for package in PACKAGES:
    for path in sorted((ROOT / package).rglob("*.py")):
      if path.name == "__init__.py":
        continue
      body = ast.parse(path.read_text()).body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
      if body and all(isinstance(node, (ast.Import, ast.ImportFrom)) for node in body):
        shims.append(str(path.relative_to(ROOT)))
  assert not shims, f"modules that only re-export names: {shims}"
