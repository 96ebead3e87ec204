"""benchmarks/multi_gpu.py: its HLO collective counting, the equivalence check's power to
find a sharding defect, the layouts a model can take, the GPU timeline split, and its
--smoke mode on CPU."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import multi_gpu, synthetic_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_collectives_are_read_from_hlo_text():
  text = """
  %all-gather-start = (bf16[2,256,4,64]{3,2,1,0}, bf16[4,256,4,64]{3,2,1,0}) all-gather-start(bf16[2,256,4,64]{3,2,1,0} %p), channel_id=1
  %all-gather-done = bf16[4,256,4,64]{3,2,1,0} all-gather-done((bf16[2,256,4,64]{3,2,1,0}, bf16[4,256,4,64]{3,2,1,0}) %all-gather-start)
  %all-gather.2 = f32[384,1024]{1,0} all-gather(f32[192,1024]{1,0} %w), channel_id=2, dimensions={0}
  ROOT %all-reduce.1 = f32[] all-reduce(f32[] %x), channel_id=3, to_apply=%add
  %fusion.3 = f32[8]{0} fusion(f32[8]{0} %all-reduce.1), kind=kLoop
  """
  found = multi_gpu.collectives(text)
  assert found == [("all-gather", (4, 256, 4, 64)), ("all-gather", (384, 1024)), ("all-reduce", ())]
  summary = multi_gpu.summarize_collectives(found, seq_len=256, head_dim=64)
  assert summary["counts"]["all-gather"] == 2 and summary["counts"]["all-reduce"] == 1
  assert summary["kernel_operand_all_gathers"] == [(4, 256, 4, 64)]  # the weight gather is not one


def test_a_gathered_activation_is_found_in_compiled_hlo():
  """The negative control: an activation split over the batch and gathered whole."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.device_put(jnp.ones((8, 24, 4, 16)), NamedSharding(mesh, P("data")))
  gather = jax.jit(lambda y: y * 2, out_shardings=NamedSharding(mesh, P()))
  summary = multi_gpu.summarize_collectives(multi_gpu.collectives(gather.lower(x).compile().as_text()), 24, 16)
  assert summary["kernel_operand_all_gathers"] == [(8, 24, 4, 16)]


def test_float32_equivalence_passes_and_finds_planted_sharding_defects(monkeypatch):
  """The float32 check is what tells a sharding defect from bf16 rounding: the real power
  layer passes under every layout, and a gate that mixes heads (a per-head quantity
  treated as global) or batch rows inside the per-shard kernel call fails the layouts
  that split those axes, naming the gate as the parameter that carries the error."""
  import castle_jax.ops.power.api as power_api

  def error_by_layout(rows):
    assert all(r["dtype"] == "float32" and "error" not in r for r in rows), rows
    return {r["layout"]: (r["ok"], r["max_grad_rel_err"], r["worst_grads"][0][0]) for r in rows}

  clean = error_by_layout(multi_gpu.check_equivalence("power", 2, smoke=True))
  assert all(ok and err < 1e-5 for ok, err, _ in clean.values()), clean

  kernels = power_api.power_attention_triton
  # The defects against one layout that splits batch rows and one that splits heads: FSDP
  # splits the rows as DP does, and the clean run above checked it.
  monkeypatch.setattr(multi_gpu, "layouts", lambda n: {"dp": (n, 1, 1), "tp": (1, 1, n)})
  for axis, caught in ((2, {"tp"}), (0, {"dp"})):

    def defective(q, k, v, log_g, axis=axis, **options):
      return kernels(q, k, v, jnp.broadcast_to(jnp.mean(log_g, axis=axis, keepdims=True), log_g.shape), **options)

    monkeypatch.setattr(power_api, "power_attention_triton", defective)
    found = error_by_layout(multi_gpu.check_equivalence("power", 2, smoke=True))
    assert {layout for layout, (ok, _, _) in found.items() if not ok} == caught, found
    assert all(err > 0.1 and "gate" in worst for layout, (_, err, worst) in found.items() if layout in caught)


def test_a_layout_the_model_cannot_take_is_named_not_run():
  config, seq_len, _ = multi_gpu.small_model("mha", smoke=True)
  config = dataclasses.replace(config, n_heads=6)
  problem = multi_gpu.layout_problem(config, (1, 1, 4), jax.devices()[:4], seq_len)
  assert "cannot be sharded" in problem and "(48, 6, 16)" in problem
  assert multi_gpu.layout_problem(config, (1, 1, 2), jax.devices()[:2], seq_len) is None
  assert list(multi_gpu.layouts(4)) == ["dp", "fsdp", "tp", "dp_tp"] and multi_gpu.layouts(4)["dp_tp"] == (2, 1, 2)


def test_overrides_set_typed_config_keys_and_name_unknown_ones():
  args = multi_gpu.parse_args(
    [
      "--smoke",
      "--override=power_p2_s:model.attention_kwargs.chunk_size=128",
      "--override=train.log_every=7",
      "--tokens_per_device=256",
    ]
  )
  config = multi_gpu.preset_config("power_p2_s", args, (2, 1, 1), 2, 1)
  assert config.model.attention_kwargs.chunk_size == 128 and config.train.log_every == 7
  assert config.data.batch_size == 2 * 256 // config.data.seq_len
  assert multi_gpu.preset_config("baseline_s", args, (1, 1, 1), 1, 1).train.log_every == 7
  with pytest.raises(ValueError, match="'train.stepz' is not a config key"):
    multi_gpu.preset_config(
      "baseline_s", multi_gpu.parse_args(["--smoke", "--override=train.stepz=3"]), (1, 1, 1), 1, 1
    )


def test_timeline_split_counts_exposed_collectives_and_idle_time():
  # compute [0, 10) and [25, 30); collectives [5, 20) and [28, 40): 10 + 10 ns exposed; idle [20, 25)
  kernels = [(0, 10, False), (5, 20, True), (25, 30, False), (28, 40, True)]
  split = synthetic_step.busy_breakdown([(s * 10**6, e * 10**6, c) for s, e, c in kernels], steps=2)
  assert split == {"span": 20.0, "compute": 7.5, "collective": 13.5, "exposed_collective": 10.0, "idle": 2.5}
  assert synthetic_step.busy_breakdown([], steps=1)["span"] == 0


def _smoke(tmp_path, *args, timeout=600):
  out = tmp_path / "out"
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.multi_gpu", "--smoke", f"--out={out}", *args],
    cwd=ROOT,
    env=dict(os.environ, PYTHONPATH=ROOT),
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  rows = json.load(open(out / "results.json"))["rows"]
  return done, rows


@pytest.mark.slow  # ~40 s of interpret-mode kernels on CPU; the multi-GPU run is the real check
def test_smoke_equivalence_of_the_power_kernels(tmp_path):
  done, rows = _smoke(tmp_path, "--parts=equivalence", "--attentions=power")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert [r["layout"] for r in rows] == ["dp", "fsdp", "tp", "dp_tp"] and all(r["ok"] for r in rows)
  assert rows[1]["counts"]["all-gather"] > 0  # FSDP gathers weights, never the kernel's operands
  assert "| equivalence | power (triton, float32) | tp | 8 |" in done.stdout


@pytest.mark.slow
def test_smoke_every_part(tmp_path):
  done, rows = _smoke(tmp_path, "--attentions=mha,castle", "--presets=castle_s")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  parts = [r["part"] for r in rows]
  assert parts.count("restart") == 1 and parts.count("equivalence") == 8 and parts.count("scaling") == 5
  restart = rows[0]
  assert restart["resumed_from_step"] == max(restart["checkpoints_after_kill"]) < restart["killed_after_step"]
  assert restart["max_loss_rel_diff"] <= 1e-6


def test_per_device_rates_count_the_devices_of_the_mesh_not_of_the_host():
  """A 1-device row of the scaling part runs on a host with 8 devices: its FLOP rate and MFU
  per device divide by the 1 device it used."""
  from castle_jax.models import ModelConfig, training_flops_per_token

  args = multi_gpu.parse_args(["--smoke"])
  for devices, sizes in ((1, (1, 1, 1)), (2, (2, 1, 1))):
    config = multi_gpu.preset_config("baseline_s", args, sizes, devices, 2)
    result = synthetic_step.measure(config, steps=1)
    flops = result["tokens_per_s"] * training_flops_per_token(ModelConfig.from_mapping(config.model), result["seq_len"])
    assert result["devices"] == devices
    assert result["model_tflops_per_s_per_device"] == pytest.approx(flops / devices / 1e12, rel=1e-9)
