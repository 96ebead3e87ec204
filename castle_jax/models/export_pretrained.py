"""Turns a training workdir into a shipped asset (`castle_jax.models.pretrained`).

    python -m castle_jax.models.export_pretrained --workdir=runs/vt/castle_2_heads/seed_1 \
        --name=variable_tracking_castle_2_heads [--step=5000] [--out_dir=castle_jax/assets]

Writes `<out_dir>/<name>.config.json` (the workdir's config.json as training wrote it) and
`<out_dir>/<name>.npz` (the parameters of the newest good checkpoint, or of --step, in
float16, one array per parameter named by its "/"-joined Flax path), then loads them back
as `load_pretrained` does and checks that every parameter equals the checkpoint's to
float16 rounding. Refuses to replace an existing asset.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
from flax import traverse_util

from castle_jax import command_line as cl
from castle_jax.checkpoints import CheckpointError
from castle_jax.models import pretrained
from castle_jax.workdir import load_trained_model, read_config

DEFAULT_OUT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")


def export_pretrained(workdir: str, name: str, out_dir: str = DEFAULT_OUT_DIR, step: int | None = None) -> int:
  """Writes the asset `name` from `workdir` into `out_dir`; returns the checkpoint step exported.

  Raises:
    ValueError: `workdir` is not a directory, `name` is not a plain file name, or an asset
      of that name exists in `out_dir`.
    CheckpointError (from the workdir): no checkpoint, or no checkpoint at `step`.
  """
  if not os.path.isdir(workdir):
    raise ValueError(
      f"--workdir={workdir!r} is not a directory: pass a training workdir (one seed's, e.g. runs/x/seed_0)"
    )
  if not name or os.sep in name or name.startswith(".") or name.endswith(pretrained.CONFIG_SUFFIX):
    raise ValueError(f"--name={name!r} must be a plain file name (e.g. variable_tracking_castle), without a suffix")
  paths = [os.path.join(out_dir, name + suffix) for suffix in (pretrained.CONFIG_SUFFIX, pretrained.PARAMS_SUFFIX)]
  existing = [path for path in paths if os.path.exists(path)]
  if existing:
    raise ValueError(f"--name={name!r}: {existing[0]} exists (never replaced); pick another --name or move it away")
  config = read_config(workdir)
  _, params, _, step = load_trained_model(workdir, step)
  flat = traverse_util.flatten_dict(jax.device_get(params), sep="/")
  os.makedirs(out_dir, exist_ok=True)
  with open(paths[1], "wb") as f:
    np.savez(f, **{path: np.asarray(value, np.float16) for path, value in flat.items()})
  with open(paths[0], "w") as f:
    json.dump(config.to_dict(), f, indent=1)
  _check_round_trip(out_dir, name, flat)
  return step


def _check_round_trip(out_dir: str, name: str, flat: dict) -> None:
  """Loads the asset back as `load_pretrained` does; its parameters must equal `flat` in float16."""
  _, params, _ = pretrained.load_pretrained(name, directory=out_dir)
  loaded = traverse_util.flatten_dict(params, sep="/")
  for path, value in flat.items():
    expected = np.asarray(value, np.float16).astype(np.float32)
    if not np.array_equal(np.asarray(loaded[path]), expected):
      raise AssertionError(f"{name}: parameter {path} reads back different from what was written")


def parse_args(argv):
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True, help="a training workdir (one seed's)")
  parser.add_argument("--name", required=True, help="the asset's name (load_pretrained(name))")
  parser.add_argument(
    "--step", type=cl.positive_int, default=None, help="checkpoint step (default: the newest good one)"
  )
  parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR, help="where the asset goes (default: the package's assets)")
  return parser.parse_args(argv)


def main(argv) -> int:
  args = parse_args(argv)
  step = export_pretrained(args.workdir, args.name, args.out_dir, args.step)
  print(
    f"wrote {args.name}{pretrained.CONFIG_SUFFIX} and {args.name}{pretrained.PARAMS_SUFFIX} (step {step}) to {args.out_dir}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main, errors=(cl.UsageError, ValueError, CheckpointError)))
