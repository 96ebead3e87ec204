"""Small shared utilities for the tests: the relative-norm error and the tolerance policy."""

import chex
import jax
from jax.sharding import AbstractDevice, AbstractMesh
import jax.numpy as jnp
import numpy as np

# The tolerance policy: the relative-norm error against a float32/float64 reference may
# reach this, by the dtype the compared path computes in.
TOLERANCES = {
  jnp.dtype(jnp.float64): 1e-12,
  jnp.dtype(jnp.float32): 1e-5,
  jnp.dtype(jnp.bfloat16): 1e-2,
  jnp.dtype(jnp.float16): 1e-2,
}


def rel_err(x, y) -> float:
  """||x - y|| / ||y||, in float64."""
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def assert_close(actual, expected, tol: float | None = None) -> None:
  """Relative-norm closeness of two pytrees of arrays, leaf by leaf.

  Structures and shapes must match (chex); each leaf's ||actual - expected|| / ||expected||
  must stay below `tol`, by default TOLERANCES[the actual leaf's dtype]. The message names
  the leaf and the error.
  """
  chex.assert_trees_all_equal_shapes(actual, expected)

  def check(path, a, e):
    limit = TOLERANCES[jnp.dtype(a.dtype)] if tol is None else tol
    error = rel_err(a, e)
    assert error < limit, f"{jax.tree_util.keystr(path) or 'value'}: relative error {error:.3g} >= {limit:.3g}"

  jax.tree_util.tree_map_with_path(check, actual, expected)


# The tiny model and run of the training tests, as config values ("section.key") and
# as command-line overrides.
TINY_RUN_SETTINGS = {
  "model.d_model": 32,
  "model.n_layers": 1,
  "model.n_heads": 2,
  "data.seq_len": 32,
  "data.batch_size": 8,
  "train.steps": 8,
  "train.warmup_steps": 2,
  "train.log_every": 1,
  "train.eval_every": 4,
  "train.eval_batches": 0,
  "train.checkpoint_every": 4,
  "train.progress_bar": False,
}


def tiny_run(config_module, workdir: str, data_dir: str, **overrides):
  """`config_module.get_config()` shrunk to TINY_RUN_SETTINGS plus `overrides`
  ({"section.key": value}), training into `workdir` on the corpus in `data_dir`."""
  import copy

  c = copy.deepcopy(config_module.get_config())
  with c.unlocked():
    c.workdir = workdir
    c.data.data_dir = data_dir
    for key, value in {**TINY_RUN_SETTINGS, **overrides}.items():
      section, name = key.split(".")
      c[section][name] = value
  return c


def run_seed_script(name: str, tmp_path, *, python: str | None = None, timeout: int = 900, **settings):
  """Runs benchmarks/<name> with bash, OUT and RUNS under tmp_path, PYTHON (this interpreter by
  default) and `settings` as environment variables; the CompletedProcess (output captured)."""
  import os
  import subprocess
  import sys

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = {
    **os.environ,
    "PYTHON": python or sys.executable,
    "OUT": str(tmp_path / "out"),
    "RUNS": str(tmp_path / "runs"),
    **settings,
  }
  # One CPU device per process, as on a machine without the test suite's fake devices.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
  script = os.path.join(root, "benchmarks", name)
  return subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=timeout)


class Interrupt(Exception):
  """Raised from a training callback to stop a run between steps."""


# Compute capabilities the op tests' `device` fixture (tests/ops/conftest.py) fakes.
HOPPER = "9.0"
AMPERE = "8.0"


def lowered_for_h100(f, inputs) -> str:
  """The StableHLO text of jit(f)(*inputs) lowered for an H100, on any machine."""
  mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H100 80GB HBM3", None, "cuda"))
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(f).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()


def mosaic_kernels_lowered_for_h100(functions, inputs) -> list[int]:
  """How many Mosaic GPU kernel calls each function's program has, lowered for an H100 on CPU."""
  return [lowered_for_h100(f, inputs).count("custom_call @mosaic_gpu") for f in functions]


def random_longspec_pair(target_config, window: int = 8):
  """(target, target_params, draft, draft_params) with random weights (keys 0 and 1): a
  model of `target_config` and its one-block LongSpec draft with a ring of `window`."""
  import dataclasses

  import flax.linen as nn

  from castle_jax.models import build_model, longspec_draft

  target = build_model(target_config)
  target_params = nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
  draft_config = dataclasses.replace(target_config, family="longspec_draft", family_kwargs=(("window", window),))
  draft = build_model(draft_config)
  draft_params = nn.unbox(longspec_draft.init_variables(draft, jax.random.key(1), 8)["params"])
  return target, target_params, draft, draft_params
