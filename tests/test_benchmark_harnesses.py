"""The per-op benchmark harnesses run end to end on tiny shapes (`--smoke`): every
implementation of the op's table gets a timed row (the kernels in interpret mode on a CPU),
next to the standard-attention baseline, and the table is printed. So does LongSpec's
step-against-round harness (`longspec_speed`), with a tiny random target and draft."""

import json

import jax
import jax.numpy as jnp
import pytest

from castle_jax import command_line as cl
from castle_jax.sharding import on_mesh
from castle_jax.workdir import tensor_parallel_mesh

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


def test_longspec_speed_runs_tensor_parallel_and_refuses_a_split_the_heads_do_not_take(capsys):
  """On 2 of the 8 CPU devices the target's and the draft's parameters and the caches are
  split by heads, and the step and the round run; 4 ways does not divide the tiny target's 2
  key/value heads."""
  assert longspec_speed.main(["--smoke", "--tensor=2"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert "x 2, tensor parallel" in lines[-4], lines[-4]
  assert "skipped" not in lines[-1] and "Error" not in lines[-1], lines[-1]
  with pytest.raises(cl.UsageError, match="--tensor=4 does not divide the model's 4 attention heads and 2 key/value"):
    longspec_speed.main(["--smoke", "--tensor=4"])

  mesh = tensor_parallel_mesh(2)
  with on_mesh(mesh):
    target, target_params, _, draft_params = longspec_speed.models("tiny", mesh)
    caches = longspec_speed._random_caches(target, 2, 64, jax.random.key(0), jnp.int32(10), mesh)
  split = lambda x: "tensor" in jax.tree.leaves(tuple(x.sharding.spec))
  assert any(split(x) for x in jax.tree.leaves(target_params)) and any(split(x) for x in jax.tree.leaves(draft_params))
  assert all(
    tuple(c.keys.sharding.spec)[2] == "tensor" and tuple(c.values.sharding.spec)[2] == "tensor" for c in caches
  )
