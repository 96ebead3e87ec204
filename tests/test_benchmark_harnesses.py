"""The per-op benchmark harnesses run end to end on tiny shapes (`--smoke`): every
implementation of the op's table gets a timed row (the kernels in interpret mode on a CPU),
next to the standard-attention baseline, and the table is printed."""

import pytest

from benchmarks import castle_attention, gca_attention, power_attention, tree_attention


@pytest.mark.parametrize(
  "harness, rows",
  [
    (castle_attention, ["castle_xla", "castle_triton", "castle_mosaic", "mha_xla"]),
    (power_attention, ["xla[c=64]", "triton[c=64]", "xla_mha"]),
    (gca_attention, ["gca_xla", "gca_triton", "gca_mosaic", "dense_same_work_xla", "window_64_xla"]),
    (tree_attention, ["xla", "triton", "mosaic", "xla cache part", "triton cache part", "mosaic cache part"]),
  ],
)
def test_smoke_run_times_every_implementation(harness, rows, capsys):
  assert harness.main(["--smoke"]) == 0
  table = capsys.readouterr().out.split("\n\n")[-1]
  for name in rows:
    line = next((line for line in table.splitlines() if f" {name} " in f" {line.strip(' |')} "), None)
    assert line is not None, f"no row {name!r} in\n{table}"
    assert "Error" not in line, line
