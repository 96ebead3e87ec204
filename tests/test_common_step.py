"""`python -m castle_jax.eval.common_step`: the newest checkpoint step every run holds."""

import os

import pytest

from castle_jax.eval.common_step import checkpoint_steps, main


def runs_with_steps(tmp_path, **steps_of):
  """Workdirs named by the keywords, each with step folders as a finished save leaves them;
  a save still in progress (Orbax's temporary folder) is not a step."""
  workdirs = {}
  for name, steps in steps_of.items():
    workdirs[name] = str(tmp_path / name)
    for step in steps:
      os.makedirs(os.path.join(workdirs[name], "checkpoints", str(step)))
    os.makedirs(os.path.join(workdirs[name], "checkpoints", "900.orbax-checkpoint-tmp-1"))
  return workdirs


def test_the_newest_step_every_run_holds_is_printed(tmp_path, capsys):
  runs = runs_with_steps(tmp_path, a=[100, 200, 300], b=[100, 200], c=[50, 100, 200, 250])
  assert checkpoint_steps(runs["a"]) == [100, 200, 300]
  assert main(list(runs.values())) == 0
  assert capsys.readouterr().out == "200\n"


@pytest.mark.parametrize(
  "steps_of, message",
  [
    ({"a": [100], "b": [200]}, "no checkpoint step is held by every run ({a}: [100]; {b}: [200])"),
    ({"a": [100], "b": []}, "{b} ({b}) has no checkpoints"),
    ({}, "no runs given: pass the workdirs of the runs to compare"),
  ],
)
def test_runs_that_share_no_step_fail_with_one_line_naming_their_steps(tmp_path, capsys, steps_of, message):
  runs = runs_with_steps(tmp_path, **steps_of)
  assert main(list(runs.values())) == 1
  assert capsys.readouterr().err.strip() == "ERROR: " + message.format(**runs)


def test_an_unknown_flag_is_refused(tmp_path, capsys):
  assert main(["--step=3", str(tmp_path)]) == 1
  assert "--step=3: unknown flag" in capsys.readouterr().err
