"""Test-wide set-up: 8 fake CPU devices so sharding tests run on any machine, and
cheap compiles on a CPU.

XLA reads the device count once, when the backend starts, so it is set here, before
any test runs a jax operation.

On a CPU the suite's time goes to compiling thousands of tiny programs (jit, eager
primitives, Pallas interpret mode), not to running them: JAX's
`jax_disable_most_optimizations` (LLVM at -O0, no expensive passes) cuts that by about
40%. It changes float32 results only by rounding, within the tolerances the tests
compare with (a test must not rely on the compiler cancelling a rounding error). It is
set through the environment so that the training subprocesses and notebook kernels that
tests start inherit it. GPU runs keep the full optimization: they compile what users run.

The Mosaic GPU kernels run on CPU in GPU interpret mode, each warpgroup as a thread whose
XLA CPU program may hand its blocking barrier waits to XLA's intra-op thread pool. That
pool has one thread per core, so a kernel with more warpgroups than cores (three on the
2-core CI machine) can starve one and hang. `--xla_cpu_enable_concurrency_optimized_scheduler=false`
keeps every program on its own thread; XLA reads it when the backend starts, so it is set
here too.
"""

import gc
import getpass
import os
import tempfile
from typing import Any, NamedTuple

_CHEAP_COMPILES = "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ  # an explicit setting wins
if _CHEAP_COMPILES:
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
_INTERPRET_XLA_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
if _INTERPRET_XLA_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_INTERPRET_XLA_FLAG}".strip()

# Many tests compile the same programs (a tiny model's training step, in-process and in the
# training subprocesses they start): a compilation cache shared by the whole run, workers and
# subprocesses included, compiles each once. Kept between runs (the key holds the jax version,
# the flags and the program); an explicit setting wins.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
    tempfile.gettempdir(), f"castle_jax_test_compilation_cache_{getpass.getuser()}"
  )
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import chex  # noqa: E402  (after the environment it reads)
import jax  # noqa: E402
import pytest  # noqa: E402

chex.set_n_cpu_devices(8)
if _CHEAP_COMPILES and jax.default_backend() != "cpu":
  jax.config.update("jax_disable_most_optimizations", False)
  os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS")


def pytest_collection_modifyitems(config, items):
  if config.getoption("loadgroup", default=False):
    _name_xdist_groups(items)
  if jax.default_backend() == "gpu":
    return
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)


# Every program XLA compiles for the CPU keeps its machine code in memory mappings of its own
# (code, read-only data, data) for as long as jax's caches hold it, and a test process compiles
# thousands: ~3,500 programs (10,500 mappings) in 100 s of the kernel tests alone. Linux refuses
# mappings past vm.max_map_count (65,530 by default), and XLA then crashes inside a compile or a
# compilation-cache write; a long-lived pytest-xdist worker reached it after 15-30 minutes. So
# after any test that leaves the process above half the limit, jax's caches are cleared: later
# tests compile again (or load from the persistent compilation cache), and nothing is lost.
_MAP_FRACTION = 0.5


def memory_map_count() -> int | None:
  """This process's memory mappings (Linux), else None."""
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(chunk.count(b"\n") for chunk in iter(lambda: maps.read(1 << 20), b""))
  except OSError:
    return None


def memory_map_limit() -> int | None:
  """vm.max_map_count (Linux), else None."""
  try:
    with open("/proc/sys/vm/max_map_count") as limit:
      return int(limit.read())
  except (OSError, ValueError):
    return None


def release_compiled_programs_near_the_map_limit(count=memory_map_count, limit=memory_map_limit) -> bool:
  """Clears jax's caches when the process holds more than `_MAP_FRACTION` of the mappings
  the kernel allows; True if it did."""
  mappings, most = count(), limit()
  if mappings is None or most is None or mappings <= _MAP_FRACTION * most:
    return False
  jax.clear_caches()
  gc.collect()
  return True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  release_compiled_programs_near_the_map_limit()


def _name_xdist_groups(items):
  """Appends "@<group>" to the test ids of `xdist_group` tests, which is how `--dist
  loadgroup` keeps a group on one worker (so a module's costly fixtures are built once):
  pytest-xdist 3.8 writes the suffix into `item._nodeid`, which pytest 9 no longer reads
  (an item's id is `item._id`), so without this the groups are spread like any test."""
  from _pytest.nodeid import coerce_node_id

  for item in items:
    groups = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    if groups and not item.nodeid.endswith("@" + "_".join(sorted(groups))):
      item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(sorted(groups))}")


@pytest.fixture
def full_float32_matmuls():
  """float32 tolerances assume float32 matmuls; GPUs default to TF32 for them."""
  with jax.default_matmul_precision("highest"):
    yield


@pytest.fixture(scope="session")
def stdlib_data_dir(tmp_path_factory):
  """A TFDS data dir with the real python_stdlib corpus built in it (~1 s)."""
  from castle_jax.data.pipeline import get_builder

  data_dir = str(tmp_path_factory.mktemp("tfds"))
  get_builder("python_stdlib", data_dir)
  return data_dir


@pytest.fixture(scope="session")
def small_source_dir(tmp_path_factory):
  """A directory of 12 small synthetic .py files of different lengths."""
  root = tmp_path_factory.mktemp("small_src")
  for i in range(12):
    package = root / f"pkg{i % 3}"
    package.mkdir(exist_ok=True)
    body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # é{j}\n" for j in range(3 + 5 * i))
    (package / f"module_{i}.py").write_text(body, encoding="utf-8")
  (root / "__pycache__").mkdir()
  (root / "__pycache__" / "ignored.py").write_text("ignored = True\n")
  return str(root)


@pytest.fixture()
def tiny_run_config(tmp_path, stdlib_data_dir):
  """configs/tiny.py shrunk to `helpers.TINY_RUN_SETTINGS`, in a fresh workdir."""
  from configs import tiny
  from helpers import tiny_run

  return tiny_run(tiny, str(tmp_path / "run"), stdlib_data_dir)


class FinishedRun(NamedTuple):
  config: Any  # ml_collections.ConfigDict: deepcopy it before changing anything
  result: Any  # train.trainer.TrainResult
  losses: dict[int, float]  # the train loss of every step


@pytest.fixture(scope="session")
def finished_tiny_run(tmp_path_factory, stdlib_data_dir) -> FinishedRun:
  """`tiny_run_config`'s run, finished, with one eval batch: 8 steps, evals and
  checkpoints at steps 4 and 8. Trained once for the tests that only read a trained
  workdir or compare with its loss curve; a test that writes to it works on a copy."""
  from configs import tiny
  from helpers import tiny_run
  from train.metrics import read_metrics
  from train.trainer import train

  config = tiny_run(
    tiny, str(tmp_path_factory.mktemp("finished") / "run"), stdlib_data_dir, **{"train.eval_batches": 1}
  )
  result = train(config)
  losses = {s: r["loss"] for s, r in read_metrics(os.path.join(config.workdir, "metrics.jsonl")).items()}
  return FinishedRun(config, result, losses)
