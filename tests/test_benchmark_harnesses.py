"""The per-op benchmark harnesses run end to end on tiny shapes (`--smoke`): every
implementation of the op's table gets a timed row (the kernels in interpret mode on a CPU),
next to the standard-attention baseline, and the table is printed. So does LongSpec's
step-against-round harness (`longspec_speed`), with a tiny random target and draft."""

import json

import pytest

from benchmarks import castle_attention, gca_attention, longspec_speed, power_attention, tree_attention


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


def test_longspec_speed_smoke_run_times_a_step_and_a_round(tmp_path, capsys):
  out = tmp_path / "speed.json"
  assert longspec_speed.main(["--smoke", f"--out={out}"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert "projection tau=3.28" in lines[-3] and "projection tau=5.33" in lines[-3], lines[-3]
  (row,) = json.loads(out.read_text())["rows"]
  assert "error" not in row, row
  assert row["ar_step_ms"] > 0 and row["round_ms"] > 0
  ratio = row["ar_step_ms"] / row["round_ms"]
  assert row["projected_speedup"] == {"3.28": pytest.approx(3.28 * ratio), "5.33": pytest.approx(5.33 * ratio)}


def test_longspec_speed_skips_a_row_the_device_cannot_hold(monkeypatch, capsys):
  monkeypatch.setattr(longspec_speed, "_memory_limit", lambda: 1024)
  assert longspec_speed.main(["--smoke"]) == 0
  assert "skipped: needs" in capsys.readouterr().out.strip().splitlines()[-1]
