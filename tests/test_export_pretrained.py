"""`python -m castle_jax.models.export_pretrained`: a trained workdir becomes an asset that
`load_pretrained` reads back, equal to the checkpoint to float16 rounding, with the same
outputs; bad input refused in one line."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from castle_jax.models.export_pretrained import export_pretrained
from castle_jax.models.pretrained import available_pretrained, load_pretrained
from castle_jax.workdir import load_trained_model


def test_a_workdir_exports_and_loads_back(finished_tiny_run, tmp_path):
  workdir = finished_tiny_run.config.workdir
  out = str(tmp_path / "assets")
  assert export_pretrained(workdir, "tiny_lm", out) == 8
  assert available_pretrained(out) == ["tiny_lm"]
  model, params, config = load_pretrained("tiny_lm", directory=out)
  with open(os.path.join(workdir, "config.json")) as f:
    assert config.to_dict() == json.load(f)
  trained = load_trained_model(workdir)
  flat = traverse_util.flatten_dict(params, sep="/")
  for path, value in traverse_util.flatten_dict(trained.params, sep="/").items():
    np.testing.assert_allclose(flat[path], value, rtol=1e-3, atol=1e-4, err_msg=path)
    assert flat[path].dtype == value.dtype, path
  tokens = jnp.arange(16, dtype=jnp.int32)[None] % 200
  logits = lambda m, p: m.apply({"params": p}, tokens)[0]
  np.testing.assert_allclose(logits(model, params), logits(trained.model, trained.params), atol=2e-2)
  # An earlier step is another checkpoint.
  assert export_pretrained(workdir, "tiny_lm_step4", out, step=4) == 4
  at_4 = traverse_util.flatten_dict(load_pretrained("tiny_lm_step4", directory=out).params, sep="/")
  assert any(not np.array_equal(at_4[path], flat[path]) for path in flat)


def test_bad_input_is_refused(finished_tiny_run, tmp_path):
  workdir = finished_tiny_run.config.workdir
  out = str(tmp_path / "assets")
  with pytest.raises(ValueError, match="is not a directory"):
    export_pretrained(str(tmp_path / "nowhere"), "x", out)
  for name in ("", "a/b", ".hidden", "x.config.json"):
    with pytest.raises(ValueError, match="must be a plain file name"):
      export_pretrained(workdir, name, out)
  export_pretrained(workdir, "x", out)
  with pytest.raises(ValueError, match="exists \\(never replaced\\)"):
    export_pretrained(workdir, "x", out)
  copy = str(tmp_path / "no_checkpoints")
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("checkpoints"))
  with pytest.raises(Exception, match="checkpoint"):
    export_pretrained(copy, "y", out)
  assert not os.path.exists(os.path.join(out, "y.npz"))
