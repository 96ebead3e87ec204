"""Multi-GPU checks and scaling on one host, in one run (about 5-8 minutes on 2 GPUs).

    python benchmarks/multi_gpu.py [--out=DIR] [--parts=equivalence,restart,scaling] [--devices=N]
    python benchmarks/multi_gpu.py --smoke      # CPU, 8 fake devices, tiny shapes (interpret-mode kernels)

Parts (each in its own try/except: one failure does not lose the others):
  equivalence  For attention mha (cuDNN on GPU, XLA on CPU), castle (Pallas) and power
               (Pallas, p=2): loss and every parameter gradient of a small model on N
               devices under data parallelism (N,1,1), FSDP (1,N,1) and tensor parallelism
               (1,1,N) equal the 1-device results (relative-norm error; bf16 on GPU).
               Counts the collectives in each compiled HLO (all-gather, all-reduce,
               reduce-scatter, all-to-all, collective-permute) and checks that no
               all-gather produces a kernel operand: a [batch, seq, heads, head_dim]-shaped
               activation (FSDP's weight all-gathers have no sequence axis).
  restart      A 2-process training job (one process per device, `python -m train` joined
               through JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID): SIGKILL
               process 1 mid-run (process 0 is then killed too, as a scheduler would),
               relaunch the same command; the resumed loss curve equals an uninterrupted
               2-process run. Needs the data pipeline (grain, tfds).
  scaling      tokens/s per device of baseline_s, castle_s, power_p2_s (their widths, heads,
               vocabulary and sequence length; --layers of depth to bound compile time) on
               1 device and on N devices with DP, FSDP and TP, the same per-device batch
               (weak scaling; TP splits the N x larger batch's heads). Efficiency =
               per-device tokens/s / 1-device tokens/s; DP should reach >= 90%.
Prints a table last; writes results.json (every number and error) under --out
(default $OUT, else ./multi_gpu_out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
PRESETS = ("baseline_s", "castle_s", "power_p2_s")


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT") or "multi_gpu_out", help="results directory")
  parser.add_argument("--smoke", action="store_true", help="CPU, 8 fake devices, tiny shapes")
  parser.add_argument("--parts", default="equivalence,restart,scaling")
  parser.add_argument("--devices", type=int, default=0, help="N (default: all local devices)")
  parser.add_argument("--attentions", default="mha,castle,power")
  parser.add_argument("--presets", default=",".join(PRESETS))
  parser.add_argument("--layers", type=int, default=None, help="scaling: layers of each preset (0: the preset's; "
                      "default 4, smoke 1)")
  parser.add_argument("--per_device_batch", type=int, default=None, help="scaling: sequences per device (8, smoke 2)")
  parser.add_argument("--steps", type=int, default=None, help="scaling: timed steps after 2 warm-up steps (5, smoke 2)")
  parser.add_argument("--restart_steps", type=int, default=0, help="restart: steps (0: 300 on GPU, 60 smoke)")
  parser.add_argument("--budget_s", type=float, default=450, help="skip what would start after this many seconds")
  args = parser.parse_args(argv)
  for name, default, smoke in (("layers", 4, 1), ("per_device_batch", 8, 2), ("steps", 5, 2)):
    if getattr(args, name) is None:
      setattr(args, name, smoke if args.smoke else default)
  return args


def free_port() -> int:
  """A TCP port no one listens on now (for the coordinator of a local job)."""
  import socket
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:  # before jax starts
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]


# --- HLO collectives ------------------------------------------------------------------------------

_COLLECTIVE_LINE = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b[a-z][a-z0-9]*\[([0-9,]*)\]")


def collectives(hlo_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """(collective, result shape) of every collective instruction in compiled HLO text
  (async pairs counted once, at their -start)."""
  found = []
  for line in hlo_text.splitlines():
    match = _COLLECTIVE_LINE.search(line)
    if match and "-done" not in line.split("=")[0]:
      shapes = _SHAPE.findall(match.group(1))
      shape = tuple(int(d) for d in shapes[-1].split(",") if d) if shapes else ()
      found.append((match.group(2), shape))
  return found


def summarize_collectives(found, seq_len: int, head_dim: int) -> dict:
  """Counts per collective, and the all-gathers of kernel operands: rank-4 results
  [batch, seq_len, heads, head_dim] (an activation split over batch or heads gathered
  whole); `activation_all_gathers` are any all-gathers with a sequence axis."""
  counts = {name: sum(1 for n, _ in found if n == name) for name in COLLECTIVES}
  gathers = [shape for name, shape in found if name == "all-gather"]
  operand = [s for s in gathers if len(s) == 4 and s[1] == seq_len and s[3] == head_dim]
  activation = [s for s in gathers if len(s) >= 3 and s[1] == seq_len]
  return {"counts": counts, "kernel_operand_all_gathers": operand, "activation_all_gathers": activation,
          "all_gather_shapes": sorted(set(gathers))[:20]}


# --- equivalence and collectives ------------------------------------------------------------------

def small_model(attention: str, smoke: bool):
  """(ModelConfig, seq_len, batch): a 2-layer model whose dims differ from seq_len, so
  that only activations have a sequence-length axis."""
  from castle_jax.models import ModelConfig
  import jax
  on_gpu = jax.default_backend() == "gpu"
  impl = {"mha": "cudnn" if on_gpu else "xla", "castle": "pallas", "power": "pallas"}[attention]
  kwargs = {"power": (("p", 2), ("chunk_size", 64 if smoke else 128))}.get(attention, ())
  if smoke:
    config = ModelConfig(vocab_size=128, d_model=48, n_layers=1, n_heads=8, head_dim=16, mlp_hidden=96,
                         attention=attention, attention_impl=impl, attention_kwargs=kwargs, dtype="float32")
    return config, 64, 8
  config = ModelConfig(vocab_size=1024, d_model=384, n_layers=2, n_heads=8, head_dim=64, mlp_hidden=1024,
                       attention=attention, attention_impl=impl, attention_kwargs=kwargs, dtype="bfloat16")
  return config, 256, 16


def loss_and_grads_on(mesh_sizes, devices, model_config, host_params, batch) -> tuple[float, dict, str]:
  """(mean token loss, gradients on the host, compiled HLO text) of the model on a mesh."""
  import flax.linen as nn
  import jax
  import ml_collections
  import numpy as np
  from castle_jax.models import build_model
  from castle_jax.sharding import LOGICAL_AXIS_RULES
  from train.config import base_config
  from train.mesh import make_mesh
  from train.optimizer import make_optimizer
  from train.state import state_shardings
  from train.step import token_losses

  mesh = make_mesh(ml_collections.ConfigDict(dict(zip(("data", "fsdp", "tensor"), mesh_sizes))), devices)
  model = build_model(model_config)
  tx, _ = make_optimizer(base_config().train)
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    _, shardings = state_shardings(model, tx, mesh, batch["inputs"].shape[1])

    def loss(params, batch):
      nll, weights = token_losses(model, params, batch, pad_id=-1)
      return nll.sum() / weights.sum()

    fn = jax.jit(jax.value_and_grad(loss), in_shardings=(shardings.params, batch_sharding),
                 out_shardings=(None, shardings.params))
    params = jax.device_put(host_params, shardings.params)
    device_batch = jax.device_put(batch, batch_sharding)
    compiled = fn.lower(params, device_batch).compile()
    value, grads = compiled(params, device_batch)
    return float(value), jax.tree.map(np.asarray, jax.device_get(grads)), compiled.as_text()


def rel_err(x, y) -> float:
  import numpy as np
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def layouts(n: int) -> dict[str, tuple[int, int, int]]:
  return {"dp": (n, 1, 1), "fsdp": (1, n, 1), "tp": (1, 1, n)}


def check_equivalence(attention: str, n: int, smoke: bool) -> list[dict]:
  """One row per layout: loss/gradient errors vs 1 device and the collectives."""
  import jax
  import numpy as np
  from castle_jax.models import build_model, family_of
  import flax.linen as nn

  config, seq_len, batch_size = small_model(attention, smoke)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  host_params = jax.device_get(nn.unbox(
      family_of(build_model(config)).init_variables(build_model(config), jax.random.key(0), seq_len)["params"]))
  devices = jax.devices()
  ref_loss, ref_grads, _ = loss_and_grads_on((1, 1, 1), devices[:1], config, host_params, batch)
  tolerance = 1e-4 if config.dtype == "float32" else 2e-2
  rows = []
  for layout, sizes in layouts(n).items():
    row = {"part": "equivalence", "attention": attention, "impl": config.attention_impl, "layout": layout,
           "mesh": sizes, "devices": n, "dtype": config.dtype, "tolerance": tolerance}
    try:
      value, grads, hlo = loss_and_grads_on(sizes, devices[:n], config, host_params, batch)
      errors = jax.tree.leaves(jax.tree.map(rel_err, grads, ref_grads))
      row.update(loss=value, loss_1dev=ref_loss, loss_rel_err=abs(value - ref_loss) / abs(ref_loss),
                 max_grad_rel_err=max(errors))
      row.update(summarize_collectives(collectives(hlo), seq_len, config.qk_head_dim))
      row["ok"] = (row["loss_rel_err"] < tolerance and row["max_grad_rel_err"] < tolerance
                   and not row["kernel_operand_all_gathers"])
    except Exception as e:  # noqa: BLE001 - record and go on
      row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800], traceback=traceback.format_exc()[-3000:])
    print(f"  equivalence {attention:6s} {layout:4s} {_brief(row)}", flush=True)
    rows.append(row)
  return rows


def _brief(row) -> str:
  if "error" in row:
    return f"ERROR {row['error'][:200]}"
  counts = " ".join(f"{k}={v}" for k, v in row["counts"].items() if v)
  return (f"loss err {row['loss_rel_err']:.1e} grad err {row['max_grad_rel_err']:.1e} | {counts or 'no collectives'}"
          f" | kernel-operand all-gathers {row['kernel_operand_all_gathers'] or 0}")


# --- scaling ---------------------------------------------------------------------------------------

def preset_config(name: str, args, mesh_sizes, num_devices: int, batch: int):
  import copy
  import importlib
  config = copy.deepcopy(importlib.import_module(f"configs.{name}").get_config())
  with config.unlocked():
    m = config.model
    if args.layers:
      m.n_layers = args.layers
    if args.smoke:  # the preset's attention at toy widths
      m.d_model, m.n_heads, m.head_dim, m.mlp_hidden, m.vocab_size, m.dtype = 64, 8, 16, 128, 512, "float32"
      m.remat = False
      config.data.seq_len = 64
      m.attention_impl = "pallas" if m.attention in ("castle", "power") else None
      if "chunk_size" in m.attention_kwargs:
        m.attention_kwargs.chunk_size = 64
    config.data.batch_size = batch
    config.train.grad_accum_steps = 1
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_sizes
    config.mesh.num_devices = num_devices
  return config


def run_scaling(preset: str, n: int, args, deadline: float) -> list[dict]:
  import jax
  from synthetic_step import measure
  rows = []
  runs = [("1 device", (1, 1, 1), 1, args.per_device_batch)] + [
      (layout, sizes, n, args.per_device_batch * n) for layout, sizes in layouts(n).items()]
  single = None
  for layout, sizes, devices, batch in runs:
    row = {"part": "scaling", "preset": preset, "layout": layout, "mesh": sizes, "devices": devices, "batch": batch}
    if time.time() > deadline:
      row.update(ok=False, error="skipped: --budget_s reached")
      rows.append(row)
      continue
    try:
      config = preset_config(preset, args, sizes, devices, batch)
      result = measure(config, args.steps)
      per_device = result["tokens_per_s"] / devices
      row.update(seq_len=config.data.seq_len, n_layers=config.model.n_layers, step_s=result["step_s_median"],
                 warmup_s=result["warmup_s"], tokens_per_s=result["tokens_per_s"], tokens_per_s_per_device=per_device,
                 mfu=result["mfu"], peak_bytes_in_use=result["peak_bytes_in_use"], ok=True)
      if layout == "1 device":
        single = per_device
      elif single:
        row["efficiency"] = per_device / single
        if layout == "dp" and not args.smoke:
          row["ok"] = row["efficiency"] >= 0.9
    except Exception as e:  # noqa: BLE001
      row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800], traceback=traceback.format_exc()[-3000:])
    print(f"  scaling {preset:11s} {layout:8s} " + (
        f"{row['tokens_per_s_per_device']:.0f} tok/s/device" + (f" ({row['efficiency']:.0%})" if "efficiency" in row
                                                                else "") if "error" not in row else row["error"][:200]),
          flush=True)
    jax.clear_caches()
    rows.append(row)
  return rows


# --- kill and restart ------------------------------------------------------------------------------

def _job_env(index: int, address: str, smoke: bool) -> dict:
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
             JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(index))
  if smoke:
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  else:  # one GPU per process; deterministic reductions so that curves compare exactly
    env.update(JAX_LOCAL_DEVICE_IDS=str(index), XLA_FLAGS="--xla_gpu_deterministic_ops=true")
  return env


def _launch(workdir: str, data_dir: str, steps: int, smoke: bool, log) -> list[subprocess.Popen]:
  address = f"localhost:{free_port()}"
  settings = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "data.seq_len": 64,
              "data.batch_size": 8, "train.steps": steps, "train.warmup_steps": 5, "train.log_every": 1,
              "train.eval_batches": 0, "train.checkpoint_every": max(steps // 6, 2), "train.keep_checkpoints": 3,
              "train.progress_bar": False, "data.data_dir": data_dir}
  command = [sys.executable, "-m", "train", "--config=configs/tiny.py", f"--workdir={workdir}",
             *(f"--config.{k}={v}" for k, v in settings.items())]
  return [subprocess.Popen(command, cwd=ROOT, env=_job_env(i, address, smoke), stdout=log, stderr=subprocess.STDOUT)
          for i in range(2)]


def _metrics_lines(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip().endswith("}")]


def _wait(jobs, timeout: float) -> list[int | None]:
  end = time.time() + timeout
  for job in jobs:
    try:
      job.wait(timeout=max(end - time.time(), 0.1))
    except subprocess.TimeoutExpired:
      pass
  return [job.poll() for job in jobs]


def run_restart(args, out_dir: str) -> dict:
  steps = args.restart_steps or (60 if args.smoke else 300)
  kill_at = int(steps * 0.6)
  base = os.path.join(out_dir, "restart")
  data_dir = os.path.join(base, "tfds")
  os.makedirs(base, exist_ok=True)
  row = {"part": "restart", "steps": steps}
  with open(os.path.join(base, "jobs.log"), "w") as log:
    # Build the corpus once, in a child (this process must not start a backend on the GPUs it shares).
    subprocess.run([sys.executable, "-c", f"from castle_jax.data.pipeline import get_builder; "
                    f"get_builder('python_stdlib', {data_dir!r})"], cwd=ROOT, check=True, stdout=log,
                   stderr=subprocess.STDOUT, env=dict(os.environ, JAX_PLATFORMS="cpu",
                                                      PYTHONPATH=_job_env(0, "", True)["PYTHONPATH"]))
    start = time.time()
    reference = os.path.join(base, "uninterrupted")
    codes = _wait(_launch(reference, data_dir, steps, args.smoke, log), 240)
    row["reference_exit_codes"], row["reference_s"] = codes, time.time() - start
    if codes != [0, 0]:
      raise RuntimeError(f"the uninterrupted job exited {codes}; see {log.name}")

    killed = os.path.join(base, "killed")
    jobs = _launch(killed, data_dir, steps, args.smoke, log)
    deadline = time.time() + 240
    while time.time() < deadline and all(j.poll() is None for j in jobs):
      if len(_metrics_lines(killed)) >= kill_at:
        break
      time.sleep(0.02)
    if any(j.poll() is not None for j in jobs):
      raise RuntimeError(f"the job ended before the kill (exit codes {[j.poll() for j in jobs]}); raise "
                         "--restart_steps")
    jobs[1].send_signal(signal.SIGKILL)
    row["killed_after_step"] = max((r["step"] for r in _metrics_lines(killed)), default=0)
    # A scheduler ends the whole job when one task dies; give process 0 a few seconds alone.
    row["process0_exit_alone"] = _wait(jobs[:1], 10)[0]
    if jobs[0].poll() is None:
      jobs[0].send_signal(signal.SIGKILL)
      jobs[0].wait()
    row["checkpoints_after_kill"] = sorted(int(s) for s in os.listdir(os.path.join(killed, "checkpoints"))
                                           if s.isdigit())
    logged_before = len(_metrics_lines(killed))
    log.write(f"\n==== relaunch after killing process 1 at step {row['killed_after_step']} ====\n")
    log.flush()
    start = time.time()
    codes = _wait(_launch(killed, data_dir, steps, args.smoke, log), 240)
    row["resumed_exit_codes"], row["resumed_s"] = codes, time.time() - start
  if codes != [0, 0]:
    raise RuntimeError(f"the relaunched job exited {codes}; see {os.path.join(base, 'jobs.log')}")
  expected = {r["step"]: r["loss"] for r in _metrics_lines(reference) if r["split"] == "train"}
  resumed = {r["step"]: r["loss"] for r in _metrics_lines(killed) if r["split"] == "train"}  # last record wins
  differences = [abs(resumed[s] - expected[s]) / abs(expected[s]) for s in expected if s in resumed]
  relaunched = _metrics_lines(killed)[logged_before:]
  row.update(steps_compared=len(differences), max_loss_rel_diff=max(differences, default=None),
             resumed_from_step=relaunched[0]["step"] - 1 if relaunched else None)
  row["ok"] = len(differences) == steps and max(differences) <= 1e-6
  return row


# --- driver ----------------------------------------------------------------------------------------

def print_table(rows: list[dict]) -> None:
  print("\n| part | what | layout | devices | result | ok |")
  print("| --- | --- | --- | --- | --- | --- |")
  for r in rows:
    if r["part"] == "equivalence":
      what, result = f"{r['attention']} ({r['impl']})", _brief(r)
    elif r["part"] == "scaling":
      what = r["preset"]
      result = r.get("error") or (f"{r['tokens_per_s_per_device']:.0f} tok/s/device"
                                  + (f", {r['efficiency']:.0%} of 1 device" if "efficiency" in r else ""))
    else:
      what = r["part"]
      result = r.get("error") or (f"killed after step {r['killed_after_step']}, resumed, {r['steps_compared']} steps, "
                                  f"max loss diff {r['max_loss_rel_diff']:.1e}")
    print(f"| {r['part']} | {what} | {r.get('layout', '2 processes')} | {r.get('devices', 2)} | "
          f"{result[:160]} | {'yes' if r.get('ok') else 'NO'} |")


def main(args) -> int:
  import jax
  start = time.time()
  deadline = start + args.budget_s
  os.makedirs(args.out, exist_ok=True)
  parts = [p for p in args.parts.split(",") if p]
  rows: list[dict] = []
  info = {"argv": sys.argv, "smoke": args.smoke}

  def save():
    with open(os.path.join(args.out, "results.json"), "w") as f:
      json.dump({"info": info, "rows": rows}, f, indent=1, default=str)

  # The restart part runs first: its processes need the GPUs before this one takes their memory.
  if "restart" in parts:
    print("restart: 2 processes, SIGKILL one, relaunch", flush=True)
    try:
      rows.append(run_restart(args, args.out))
    except Exception as e:  # noqa: BLE001
      rows.append({"part": "restart", "ok": False, "error": f"{type(e).__name__}: {e}"[:800],
                   "traceback": traceback.format_exc()[-3000:]})
    print(f"  {rows[-1]}", flush=True)
    save()
  n = args.devices or jax.local_device_count()
  info.update(backend=jax.default_backend(), device=jax.devices()[0].device_kind, devices=n, jax=jax.__version__)
  print(f"{n} x {info['device']} ({info['backend']}), jax {jax.__version__}", flush=True)
  if n < 2:
    print("need at least 2 devices for equivalence and scaling", flush=True)
  if "equivalence" in parts and n >= 2:
    for attention in args.attentions.split(","):
      if time.time() > deadline:
        rows.append({"part": "equivalence", "attention": attention, "impl": "-", "ok": False,
                     "error": "skipped: --budget_s reached"})
        continue
      try:
        rows.extend(check_equivalence(attention, n, args.smoke))
      except Exception as e:  # noqa: BLE001
        rows.append({"part": "equivalence", "attention": attention, "impl": "-", "ok": False,
                     "error": f"{type(e).__name__}: {e}"[:800], "traceback": traceback.format_exc()[-3000:]})
      save()
  if "scaling" in parts and n >= 2:
    for preset in args.presets.split(","):
      try:
        rows.extend(run_scaling(preset, n, args, deadline))
      except Exception as e:  # noqa: BLE001
        rows.append({"part": "scaling", "preset": preset, "ok": False, "error": f"{type(e).__name__}: {e}"[:800]})
      save()
  info["total_s"] = time.time() - start
  save()
  print_table(rows)
  print(f"\n{sum(bool(r.get('ok')) for r in rows)}/{len(rows)} ok in {info['total_s']:.0f} s; "
        f"details in {os.path.join(args.out, 'results.json')}")
  return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main(ARGS))
