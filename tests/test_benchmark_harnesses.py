"""The per-op benchmark harnesses run end to end on tiny shapes (`--smoke`): every
implementation of the op's table gets a timed row (the kernels in interpret mode on a CPU),
next to the standard-attention baseline, and the table is printed. So does LongSpec's
step-against-round harness (`longspec_speed`), with a tiny random target and draft."""

import json
import re

import jax
import jax.numpy as jnp
import pytest

from castle_jax import command_line as cl
from castle_jax.sharding import on_mesh
from castle_jax.workdir import tensor_parallel_mesh

from benchmarks import castle_attention, gca_attention, longspec_speed, power_attention, synthetic_step, tree_attention


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


def test_tree_attention_rows_time_only_the_rows_asked(tmp_path):
  out = tmp_path / "rows.json"
  assert tree_attention.main(["--smoke", "--rows=tree", "--impls=xla", f"--out={out}"]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [(row["kind"], row["name"]) for row in rows] == [("tree", "xla")]


def test_tree_attention_profile_records_device_time_per_call_by_kernel(monkeypatch, tmp_path):
  def kernels_of_the_trace(directory, top):
    return [("stream", "tree_kernel", 8.0, 4), ("stream", "merge", 2.0, 4)]

  monkeypatch.setattr(synthetic_step, "device_time_by_op", kernels_of_the_trace)
  out = tmp_path / "tree.json"
  assert tree_attention.main(["--smoke", "--rows=tree", "--impls=xla", "--profile", f"--out={out}"]) == 0
  (row,) = json.loads(out.read_text())["rows"]
  calls = tree_attention.PROFILED_RUNS * 2 * 1  # the smoke run's layers x repeats per run
  assert row["kernel_us"] == {"tree_kernel": pytest.approx(8e3 / calls), "merge": pytest.approx(2e3 / calls)}
  assert row["device_us"] == pytest.approx(10e3 / calls)
  assert row["kernels"] == pytest.approx(8 / calls)


def test_tree_attention_rejects_an_unknown_row():
  with pytest.raises(cl.UsageError, match=r"--rows: unknown 'sparse'; choose from read, dense, tree, decode"):
    tree_attention.main(["--smoke", "--rows=tree,sparse"])


def test_longspec_speed_smoke_run_times_a_step_and_a_round(tmp_path, capsys):
  out = tmp_path / "speed.json"
  assert longspec_speed.main(["--smoke", f"--out={out}"]) == 0
  captured = capsys.readouterr()
  lines = captured.out.strip().splitlines()
  assert "projection tau=3.28" in lines[-3] and "projection tau=5.33" in lines[-3], lines[-3]
  (row,) = json.loads(out.read_text())["rows"]
  assert "error" not in row, row
  assert row["ar_step_ms"] > 0 and row["round_ms"] > 0
  assert row["ar_step_first_call_s"] > 0 and row["round_first_call_s"] > 0
  # Progress on stderr as it goes, each line stamped with the seconds since the start: the
  # parameters, the caches, each program's first call (its compilation), each median, the row.
  progress = captured.err.strip().splitlines()
  assert all(re.match(r"\[ *\d+\.\d+s\] ", line) for line in progress), progress
  expected = [
    "filling the target's",
    "target's parameters filled",
    "draft's parameters filled",
    "batch 2, prompt 64: filling the target's caches",
    "AR step: compiling",
    "AR step compiled and run once",
    "AR step: ",
    "round: compiling",
    "round compiled and run once",
    "round: ",
    '"batch": 2',
  ]
  at = 0
  for text in expected:
    at = next((i for i in range(at, len(progress)) if text in progress[i]), None)
    assert at is not None, f"no {text!r} in order in\n" + "\n".join(progress)
  ratio = row["ar_step_ms"] / row["round_ms"]
  assert row["projected_speedup"] == {"3.28": pytest.approx(3.28 * ratio), "5.33": pytest.approx(5.33 * ratio)}
  for key in ("ar_step", "round"):
    fastest, slowest = row[f"{key}_ms_range"]
    assert 0 < fastest <= row[f"{key}_ms"] <= slowest
    assert f"{key}_ops_ms" not in row  # only with --profile


def test_longspec_speed_profile_records_device_time_per_call_by_kernel(monkeypatch, tmp_path, capsys):
  traced = []

  def kernels_of_the_trace(directory, top):
    traced.append((directory, top))
    return [("stream", "gemm", 6.0, 9), ("stream", "tree_attention", 3.0, 3)]

  monkeypatch.setattr(synthetic_step, "device_time_by_op", kernels_of_the_trace)
  out = tmp_path / "speed.json"
  assert longspec_speed.main(["--smoke", "--profile", f"--out={out}"]) == 0
  (row,) = json.loads(out.read_text())["rows"]
  calls = longspec_speed.PROFILED_CALLS
  for key in ("ar_step", "round"):
    assert row[f"{key}_ops_ms"] == {"gemm": pytest.approx(6.0 / calls), "tree_attention": pytest.approx(3.0 / calls)}
    assert row[f"{key}_device_ms"] == pytest.approx(9.0 / calls)
    assert row[f"{key}_kernels"] == pytest.approx(12 / calls)
  assert [top for _, top in traced] == [None] * 2  # every kernel, for the sums
  assert re.search(
    r"round: device time per call 3\.00 ms in 4 kernels \(wall [0-9.]+ ms\); by kernel: gemm 2\.000, tree_attention 1\.000",
    capsys.readouterr().err,
  )


def test_longspec_speed_profile_sums_kernels_but_not_the_modules_spanning_them(monkeypatch, tmp_path):
  def trace_with_module_line(directory, top):
    return [("XLA Modules", "jit_step", 30.0, 3), ("XLA Ops", "gemm", 6.0, 9), ("XLA Ops", "tree_attention", 3.0, 3)]

  monkeypatch.setattr(synthetic_step, "device_time_by_op", trace_with_module_line)
  out = tmp_path / "speed.json"
  assert longspec_speed.main(["--smoke", "--profile", f"--out={out}"]) == 0
  (row,) = json.loads(out.read_text())["rows"]
  assert row["ar_step_device_ms"] == pytest.approx(9.0 / longspec_speed.PROFILED_CALLS)
  assert list(row["ar_step_ops_ms"]) == ["gemm", "tree_attention"]


def test_longspec_speed_times_sampling_rounds_at_a_temperature(tmp_path, capsys):
  out = tmp_path / "speed.json"
  assert longspec_speed.main(["--smoke", "--temperature=1", f"--out={out}"]) == 0
  (row,) = json.loads(out.read_text())["rows"]
  assert "error" not in row, row
  assert row["temperature"] == 1.0 and row["ar_step_ms"] > 0 and row["round_ms"] > 0
  assert "temperature 1," in capsys.readouterr().out
  with pytest.raises(cl.UsageError, match=r"--temperature must be >= 0 \(0 is greedy\), got -1.0"):
    longspec_speed.main(["--smoke", "--temperature=-1"])


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
    caches = longspec_speed._random_caches(target, 2, 64, 0, jnp.int32(10), mesh)
  split = lambda x: "tensor" in jax.tree.leaves(tuple(x.sharding.spec))
  assert any(split(x) for x in jax.tree.leaves(target_params)) and any(split(x) for x in jax.tree.leaves(draft_params))
  assert all(
    tuple(c.keys.sharding.spec)[2] == "tensor" and tuple(c.values.sharding.spec)[2] == "tensor" for c in caches
  )


def test_longspec_speed_hashed_fill_is_uniform_and_the_same_in_shards():
  """The parameters' and caches' fill: uniform in [-1, 1), different per seed, and the same
  values whether one device or a tensor-parallel mesh holds them."""
  x = longspec_speed._hashed_uniform((64, 4, 32), jnp.float32, jnp.uint32(3))
  assert -1 <= float(x.min()) and float(x.max()) < 1
  assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 3**-0.5) < 0.02
  assert not jnp.array_equal(x, longspec_speed._hashed_uniform((64, 4, 32), jnp.float32, jnp.uint32(4)))
  target, params, _, _ = longspec_speed.models("tiny")
  mesh = tensor_parallel_mesh(2)
  with on_mesh(mesh):
    _, sharded, _, _ = longspec_speed.models("tiny", mesh)
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
  values = jnp.concatenate([leaf.ravel().astype(jnp.float32) for leaf in jax.tree.leaves(params)])
  assert float(jnp.std(values)) == pytest.approx(target.config.init_std, rel=0.05)
  for one, split in zip(jax.tree.leaves(params), jax.tree.leaves(sharded)):
    assert jnp.array_equal(one, jax.device_get(split))
