"""The newest checkpoint step that every one of several runs holds: runs stopped at different
steps (a time limit, a crash) are evaluated there so that they compare at equal training.

    python -m castle_jax.eval.common_step RUN_DIR [RUN_DIR ...]   # prints the step

A run is a workdir with a `checkpoints/` folder (one seed of a run of several seeds:
`<workdir>/seed_<k>`). When the runs share no step, or one holds none, prints one ERROR line
naming each run's steps and exits with status 1.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

from castle_jax import command_line
from castle_jax.checkpoints import Checkpointer
from castle_jax.workdir import CHECKPOINTS_DIR


def checkpoint_steps(workdir: str) -> list[int]:
  """The complete checkpoint steps a run holds, oldest first (none without a checkpoints
  folder; a save still in progress is not one)."""
  directory = os.path.join(workdir, CHECKPOINTS_DIR)
  if not os.path.isdir(directory):
    return []
  checkpointer = Checkpointer(directory, read_only=True)
  try:
    return checkpointer.all_steps()
  finally:
    checkpointer.close()


def common_checkpoint_step(runs: Mapping[str, str]) -> int:
  """The newest step every run of {name: workdir} holds; UsageError naming the runs' steps
  when one holds none or they share none."""
  if not runs:
    raise command_line.UsageError("no runs given: pass the workdirs of the runs to compare")
  held = {name: set(checkpoint_steps(workdir)) for name, workdir in runs.items()}
  for name, steps in held.items():
    if not steps:
      raise command_line.UsageError(f"{name} ({runs[name]}) has no checkpoints")
  common = set.intersection(*held.values())
  if not common:
    listed = "; ".join(f"{name}: {sorted(steps)}" for name, steps in held.items())
    raise command_line.UsageError(f"no checkpoint step is held by every run ({listed})")
  return max(common)


def _main(argv: Sequence[str]) -> None:
  unknown = [arg for arg in argv if arg.startswith("-") and arg != "--traceback"]
  if unknown:
    raise command_line.UsageError(f"{' '.join(unknown)}: unknown flag; pass the runs' workdirs (and --traceback)")
  print(common_checkpoint_step({workdir: workdir for workdir in argv if not workdir.startswith("-")}))


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m castle_jax.eval.common_step RUN_DIR ...`; 0, or 1 after one ERROR line."""
  return command_line.run(_main, argv)


if __name__ == "__main__":
  sys.exit(main())
