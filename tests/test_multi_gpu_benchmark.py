"""benchmarks/multi_gpu.py: its HLO collective counting, and its --smoke mode on CPU."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import multi_gpu  # noqa: E402


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


def _smoke(tmp_path, *args, timeout=600):
  out = tmp_path / "out"
  done = subprocess.run([sys.executable, "benchmarks/multi_gpu.py", "--smoke", f"--out={out}", *args], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=timeout)
  rows = json.load(open(out / "results.json"))["rows"]
  return done, rows


@pytest.mark.slow  # ~40 s of interpret-mode kernels on CPU; the multi-GPU run is the real check
def test_smoke_equivalence_of_the_power_kernels(tmp_path):
  done, rows = _smoke(tmp_path, "--parts=equivalence", "--attentions=power")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert [r["layout"] for r in rows] == ["dp", "fsdp", "tp"] and all(r["ok"] for r in rows)
  assert rows[1]["counts"]["all-gather"] > 0  # FSDP gathers weights, never the kernel's operands
  assert "| equivalence | power (pallas) | tp | 8 |" in done.stdout


@pytest.mark.slow
def test_smoke_every_part(tmp_path):
  done, rows = _smoke(tmp_path, "--attentions=mha,castle", "--presets=castle_s")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  parts = [r["part"] for r in rows]
  assert parts.count("restart") == 1 and parts.count("equivalence") == 6 and parts.count("scaling") == 4
  restart = rows[0]
  assert restart["resumed_from_step"] < restart["killed_after_step"] and restart["max_loss_rel_diff"] <= 1e-6
