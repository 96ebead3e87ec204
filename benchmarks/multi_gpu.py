"""Multi-GPU checks and scaling on one host, in one run (about 5-8 minutes on 2 GPUs).

    python -m benchmarks.multi_gpu [--out=DIR] [--parts=equivalence,restart,scaling] [--devices=N]
    python -m benchmarks.multi_gpu --smoke      # CPU, 8 fake devices, tiny shapes (interpret-mode kernels)

Parts (each in its own try/except: one failure does not lose the others):
  equivalence  For attention mha (cuDNN on GPU in bf16, XLA otherwise), castle (Pallas) and
               power (Pallas, p=2): loss and every parameter gradient of a small model on N
               devices under data parallelism (N,1,1), FSDP (1,N,1), tensor parallelism
               (1,1,N) and, from 4 devices, data x tensor (N/2,1,2) equal the 1-device
               results (relative-norm error), in float32 (to 1e-4: a sharding defect shows
               there) and in bf16 (to twice the bf16 rounding error the 1-device run has
               against float32). Each row names the parameters with the largest errors.
               Counts the collectives in each compiled HLO (all-gather, all-reduce,
               reduce-scatter, all-to-all, collective-permute) and checks that no
               all-gather produces a kernel operand: a [batch, seq, heads, head_dim]-shaped
               activation (FSDP's weight all-gathers have no sequence axis).
  restart      A 2-process training job (one process per device, `python -m train` joined
               through JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID): SIGKILL
               process 1 mid-run (process 0 is then killed too, as a scheduler would),
               relaunch the same command; the resumed loss curve equals an uninterrupted
               2-process run. Needs the data pipeline (grain, tfds).
  scaling      tokens/s per device of baseline_s, castle_s, power_p2_s (--presets also takes
               castle_swl_s and the XL configs baseline_xl, castle_xl, castle_swl_xl) (their widths, heads,
               vocabulary and sequence length; --layers of depth to bound compile time, 0 for
               the preset's) on 1 device and on N devices with the layouts above, the same
               per-device batch (weak scaling; TP splits the N x larger batch's heads).
               Efficiency = per-device tokens/s / 1-device tokens/s; DP should reach >= 90%.
               --profile splits each row's GPU time into compute, collectives (and the part
               of them no compute hides) and idle.
A layout a model cannot take (e.g. 14 heads over 4-way tensor parallelism) is a skipped
row that says why. Prints a table last; writes results.json (every number and error)
under --out (default $OUT, else a new folder under ~/.cache/castle_jax/multi_gpu/); a
folder that already holds a results.json is refused.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from castle_jax import command_line as cl
from castle_jax.outputs import fresh_directory, refuse_existing, user_cache_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
PRESETS = ("baseline_s", "castle_s", "power_p2_s")  # the default of --presets
# XL configs at full depth need --tokens_per_device (the configs' batches are the paper's 0.5M tokens).
SCALING_PRESETS = PRESETS + ("castle_swl_s", "baseline_xl", "castle_xl", "castle_swl_xl")


def _choices(*names: str):
  return cl.validated_by(cl.choice_list(names), "a comma list of " + ", ".join(names))


def parse_args(argv=None):
  parser = cl.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--out", default=os.environ.get("OUT"), help="results directory (default $OUT, else a new one in the user cache)"
  )
  parser.add_argument("--smoke", action="store_true", help="CPU, 8 fake devices, tiny shapes")
  parser.add_argument(
    "--parts", type=_choices("equivalence", "restart", "scaling"), default="equivalence,restart,scaling"
  )
  parser.add_argument("--devices", type=cl.nonnegative_int, default=0, help="N (default: all local devices)")
  parser.add_argument("--attentions", type=_choices("mha", "castle", "power"), default="mha,castle,power")
  parser.add_argument("--presets", type=_choices(*SCALING_PRESETS), default=",".join(PRESETS))
  parser.add_argument(
    "--layers",
    type=cl.nonnegative_int,
    default=None,
    help="scaling: layers of each preset (0: the preset's; default 4, smoke 1)",
  )
  parser.add_argument(
    "--per_device_batch", type=cl.positive_int, default=None, help="scaling: sequences per device (8, smoke 2)"
  )
  parser.add_argument(
    "--steps", type=cl.positive_int, default=None, help="scaling: timed steps after 2 warm-up steps (5, smoke 2)"
  )
  parser.add_argument(
    "--restart_steps", type=cl.nonnegative_int, default=0, help="restart: steps (0: 300 on GPU, 60 smoke)"
  )
  parser.add_argument("--budget_s", type=float, default=450, help="skip what would start after this many seconds")
  parser.add_argument(
    "--dtypes",
    type=_choices("bfloat16", "float32"),
    default=None,
    help="equivalence: compute dtypes (default bfloat16,float32; smoke float32)",
  )
  parser.add_argument(
    "--tokens_per_device",
    type=cl.nonnegative_int,
    default=0,
    help="scaling: tokens per device per step (sequences = this / the preset's seq_len; overrides --per_device_batch)",
  )
  parser.add_argument(
    "--override",
    action="append",
    default=[],
    metavar="[PRESET:]KEY=VALUE",
    help="scaling: set a config key of every preset (or of PRESET), e.g. "
    "power_p2_s:model.attention_kwargs.chunk_size=1024; repeatable",
  )
  parser.add_argument(
    "--layouts",
    type=cl.validated_by(lambda t: t and cl.choice_list(("dp", "fsdp", "tp", "dp_tp"))(t), "dp, fsdp, tp, dp_tp"),
    default="",
    help="scaling: only these layouts besides 1 device (e.g. dp; default: every layout)",
  )
  parser.add_argument(
    "--profile",
    action="store_true",
    help="scaling: trace 2 more steps of each row and split "
    "its GPU time into compute, collectives (exposed or hidden) and idle",
  )
  args = parser.parse_args(argv)
  if args.out:
    refuse_existing(f"--out={args.out}", os.path.join(args.out, "results.json"))
  if args.dtypes is None:
    args.dtypes = "float32" if args.smoke else "bfloat16,float32"
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


def _parse_or_exit():
  try:
    return parse_args()
  except cl.UsageError as e:
    cl.exit_with_error(e)


ARGS = _parse_or_exit() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:  # before jax starts
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"


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
  return {
    "counts": counts,
    "kernel_operand_all_gathers": operand,
    "activation_all_gathers": activation,
    "all_gather_shapes": sorted(set(gathers))[:20],
  }


# --- equivalence and collectives ------------------------------------------------------------------


def small_model(attention: str, smoke: bool, dtype: str | None = None):
  """(ModelConfig, seq_len, batch): a 2-layer model whose dims differ from seq_len, so
  that only activations have a sequence-length axis. dtype: the compute dtype (default
  bfloat16 on a GPU, float32 in smoke mode); mha runs cuDNN in bf16 on a GPU and XLA
  otherwise (cuDNN has no float32 attention)."""
  from castle_jax.models import ModelConfig
  import jax

  on_gpu = jax.default_backend() == "gpu"
  dtype = dtype or ("float32" if smoke else "bfloat16")
  impl = {"mha": "cudnn" if on_gpu and dtype != "float32" else "xla", "castle": "triton", "power": "triton"}[attention]
  kwargs = {"power": (("p", 2), ("chunk_size", 64 if smoke else 128))}.get(attention, ())
  if smoke:
    config = ModelConfig(
      vocab_size=128,
      d_model=48,
      n_layers=1,
      n_heads=8,
      head_dim=16,
      mlp_hidden=96,
      attention=attention,
      attention_impl=impl,
      attention_kwargs=kwargs,
      dtype=dtype,
    )
    return config, 64, 8
  config = ModelConfig(
    vocab_size=1024,
    d_model=384,
    n_layers=2,
    n_heads=8,
    head_dim=64,
    mlp_hidden=1024,
    attention=attention,
    attention_impl=impl,
    attention_kwargs=kwargs,
    dtype=dtype,
  )
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

    fn = jax.jit(
      jax.value_and_grad(loss), in_shardings=(shardings.params, batch_sharding), out_shardings=(None, shardings.params)
    )
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
  """Mesh (data, fsdp, tensor) sizes of each layout on n devices; from 4 devices on, also
  a 2-D mesh: data parallelism over n/2 groups of 2-way tensor parallelism."""
  found = {"dp": (n, 1, 1), "fsdp": (1, n, 1), "tp": (1, 1, n)}
  if n >= 4 and n % 2 == 0:
    found["dp_tp"] = (n // 2, 1, 2)
  return found


def layout_problem(model_config, mesh_sizes, devices, seq_len: int) -> str | None:
  """Why the model cannot take this mesh (a parameter that does not split over it, e.g.
  14 heads over 4-way tensor parallelism), or None."""
  import flax.linen as nn
  import jax
  import ml_collections
  from castle_jax.models import build_model
  from castle_jax.sharding import LOGICAL_AXIS_RULES
  from train.config import base_config
  from train.mesh import make_mesh
  from train.optimizer import make_optimizer
  from train.state import state_shardings

  mesh = make_mesh(ml_collections.ConfigDict(dict(zip(("data", "fsdp", "tensor"), mesh_sizes))), devices)
  tx, _ = make_optimizer(base_config().train)
  try:
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
      state_shardings(build_model(model_config), tx, mesh, seq_len)
  except ValueError as e:
    if "cannot be sharded" in str(e):
      return str(e).split(". Change")[0]
    raise
  return None


def gradient_errors(grads, reference) -> dict[str, float]:
  """Relative-norm error of every parameter's gradient, by parameter path."""
  import jax

  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
  return dict(zip(paths, jax.tree.leaves(jax.tree.map(rel_err, grads, reference))))


def _worst(errors: dict[str, float], count: int = 3) -> list[tuple[str, float]]:
  return sorted(errors.items(), key=lambda item: -item[1])[:count]


# float32 gradients of a sharded step equal 1 device's up to reduction order: ~1e-6 on CPU
# (measured: 1.2-5.1e-6 for mha and power at 2-4 ways), so 1e-4 leaves room and still
# catches any real defect (a per-head quantity reduced over the wrong heads is O(1)).
FLOAT32_TOLERANCE = 1e-4
# bf16 gradients carry rounding error of their own; a sharded run rounds differently. Its
# gradients may differ from 1 device's by at most this many times the 1-device run's own
# rounding error (its bf16 gradient against its float32 gradient). Measured on CPU at this
# benchmark's shapes: sharded/1-device differences are 0.7-1.05x that error for mha and
# power (power's q/k gradients carry 3.9e-2 of it, mha's 1.3e-2).
BF16_ROUNDING_FACTOR = 2.0


def check_equivalence(attention: str, n: int, smoke: bool, dtypes: tuple[str, ...] = ("float32",)) -> list[dict]:
  """One row per dtype and layout: loss/gradient errors vs 1 device and the collectives.

  float32 rows must agree to FLOAT32_TOLERANCE (matmuls at full precision, no TF32): any
  real sharding defect shows there, where rounding cannot hide it. bf16 rows must agree
  to BF16_ROUNDING_FACTOR x the bf16 rounding error measured on 1 device (float32 is then
  run too, as the reference for that error).
  """
  import contextlib
  import jax
  import numpy as np
  from castle_jax.models import build_model, family_of
  import flax.linen as nn

  configs = {dtype: small_model(attention, smoke, dtype) for dtype in dict.fromkeys(("float32", *dtypes))}
  _, seq_len, batch_size = configs["float32"]
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, configs["float32"][0].vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  model = build_model(configs["float32"][0])
  host_params = jax.device_get(nn.unbox(family_of(model).init_variables(model, jax.random.key(0), seq_len)["params"]))
  devices = jax.devices()

  def precision(dtype):
    return jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()

  references = {}
  for dtype, (config, _, _) in configs.items():
    with precision(dtype):
      references[dtype] = loss_and_grads_on((1, 1, 1), devices[:1], config, host_params, batch)[:2]
  rows = []
  for dtype in dtypes:
    config = configs[dtype][0]
    ref_loss, ref_grads = references[dtype]
    row_base = {
      "part": "equivalence",
      "attention": attention,
      "impl": config.attention_impl,
      "devices": n,
      "dtype": dtype,
    }
    if dtype == "float32":
      tolerance, rounding = FLOAT32_TOLERANCE, None
    else:
      rounding_errors = gradient_errors(ref_grads, references["float32"][1])
      rounding = max(rounding_errors.values())
      tolerance = BF16_ROUNDING_FACTOR * rounding
      row_base.update(rounding_err=rounding, rounding_worst=_worst(rounding_errors))
    for layout, sizes in layouts(n).items():
      row = dict(row_base, layout=layout, mesh=sizes, tolerance=tolerance)
      try:
        problem = layout_problem(config, sizes, devices[:n], seq_len)
        if problem:
          row.update(ok=True, skipped=problem)
        else:
          with precision(dtype):
            value, grads, hlo = loss_and_grads_on(sizes, devices[:n], config, host_params, batch)
          errors = gradient_errors(grads, ref_grads)
          row.update(
            loss=value,
            loss_1dev=ref_loss,
            loss_rel_err=abs(value - ref_loss) / abs(ref_loss),
            max_grad_rel_err=max(errors.values()),
            worst_grads=_worst(errors),
          )
          row.update(summarize_collectives(collectives(hlo), seq_len, config.qk_head_dim))
          row["ok"] = (
            row["loss_rel_err"] < max(tolerance, FLOAT32_TOLERANCE)
            and row["max_grad_rel_err"] <= tolerance
            and not row["kernel_operand_all_gathers"]
          )
      except Exception as e:  # noqa: BLE001 - record and go on
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800], traceback=traceback.format_exc()[-3000:])
      print(f"  equivalence {attention:6s} {dtype:8s} {layout:5s} {_brief(row)}", flush=True)
      rows.append(row)
  return rows


def _brief(row) -> str:
  if "error" in row:
    return f"ERROR {row['error'][:200]}"
  if "skipped" in row:
    return f"skipped: {row['skipped'][:200]}"
  counts = " ".join(f"{k}={v}" for k, v in row["counts"].items() if v)
  bound = (
    f" (bound {row['tolerance']:.1e} = {BF16_ROUNDING_FACTOR:g} x bf16 rounding {row['rounding_err']:.1e})"
    if row.get("rounding_err")
    else f" (bound {row['tolerance']:.0e})"
  )
  return (
    f"loss err {row['loss_rel_err']:.1e} grad err {row['max_grad_rel_err']:.1e}{bound} | "
    f"{counts or 'no collectives'} | kernel-operand all-gathers {row['kernel_operand_all_gathers'] or 0}"
  )


# --- scaling ---------------------------------------------------------------------------------------


def _set_dotted(config, key: str, text: str) -> None:
  """config.<key> = text parsed as the field's type (an --override)."""
  *parents, leaf = key.split(".")
  node = config
  for name in parents:
    node = node[name]
  if leaf not in node:
    raise ValueError(f"--override: {key!r} is not a config key")
  current = node[leaf]
  if isinstance(current, bool):
    value = text.lower() in ("1", "true", "yes")
  elif isinstance(current, (int, float)) and not isinstance(current, bool):
    value = type(current)(text)
  elif current is None:
    value = None if text == "None" else (int(text) if text.lstrip("-").isdigit() else text)
  else:
    value = text
  node[leaf] = value


def preset_config(name: str, args, mesh_sizes, num_devices: int, batch_per_device: int):
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
      m.attention_impl = "triton" if m.attention in ("castle", "power") else None
      if "chunk_size" in m.attention_kwargs:
        m.attention_kwargs.chunk_size = 64
    for override in args.override:
      target, _, assignment = override.rpartition(":")
      if target in ("", name):
        key, _, text = assignment.partition("=")
        _set_dotted(config, key, text)
    if args.tokens_per_device:
      batch_per_device = max(1, args.tokens_per_device // config.data.seq_len)
    config.data.batch_size = batch_per_device * num_devices
    config.train.grad_accum_steps = 1
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_sizes
    config.mesh.num_devices = num_devices
  return config


def _timeline(profile_dir: str) -> dict:
  """The step's GPU time split into compute, collectives (exposed: not hidden under compute)
  and idle, per step: device 0's and the largest exposed-collective time of any device."""
  from benchmarks.synthetic_step import timeline_breakdown

  per_device = timeline_breakdown(profile_dir, steps=2)
  if not per_device:
    return {}
  first = per_device[min(per_device)]
  return {
    **{k: round(v, 3) for k, v in first.items()},
    "max_exposed_collective": round(max(d["exposed_collective"] for d in per_device.values()), 3),
  }


def run_scaling(preset: str, n: int, args, deadline: float) -> list[dict]:
  import jax
  from castle_jax.models import ModelConfig
  from benchmarks.synthetic_step import measure

  rows = []
  wanted = set(filter(None, args.layouts.split(","))) or set(layouts(n))
  runs = [("1 device", (1, 1, 1), 1)] + [(layout, sizes, n) for layout, sizes in layouts(n).items() if layout in wanted]
  single = None
  for layout, sizes, devices in runs:
    row = {"part": "scaling", "preset": preset, "layout": layout, "mesh": sizes, "devices": devices}
    if time.time() > deadline:
      row.update(ok=False, error="skipped: --budget_s reached")
      rows.append(row)
      continue
    try:
      config = preset_config(preset, args, sizes, devices, args.per_device_batch)
      row["batch"] = config.data.batch_size
      problem = layout_problem(
        ModelConfig.from_mapping(config.model), sizes, jax.devices()[:devices], config.data.seq_len
      )
      if problem:
        row.update(ok=True, skipped=problem)
      else:
        profile_dir = tempfile.mkdtemp(prefix="multi_gpu_trace_") if args.profile else None
        result = measure(config, args.steps, profile_dir)
        per_device = result["tokens_per_s"] / devices
        row.update(
          seq_len=config.data.seq_len,
          n_layers=config.model.n_layers,
          step_s=result["step_s_median"],
          warmup_s=result["warmup_s"],
          tokens_per_s=result["tokens_per_s"],
          tokens_per_s_per_device=per_device,
          mfu=result["mfu"],
          peak_bytes_in_use=result["peak_bytes_in_use"],
          ok=True,
        )
        if profile_dir:
          from benchmarks.synthetic_step import device_time_by_op

          row["timeline_ms"] = _timeline(profile_dir)
          row["ops_ms_per_step"] = {
            name: round(ms / 2 / devices, 4)  # 2 traced steps, summed over devices
            for _, name, ms, _ in device_time_by_op(profile_dir, top=80)
          }
          shutil.rmtree(profile_dir, ignore_errors=True)
        if layout == "1 device":
          single = per_device
        elif single:
          row["efficiency"] = per_device / single
          if layout == "dp" and not args.smoke:
            row["ok"] = row["efficiency"] >= 0.9
    except Exception as e:  # noqa: BLE001
      row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800], traceback=traceback.format_exc()[-3000:])
    print(f"  scaling {preset:11s} {layout:8s} {_scaling_brief(row)}", flush=True)
    jax.clear_caches()
    rows.append(row)
  return rows


def print_op_growth(rows: list[dict], count: int = 12) -> None:
  """With --profile: the GPU ops whose time per step and device grew most from 1 device to
  each layout (what a layout adds besides its collectives)."""
  single = {r["preset"]: r for r in rows if r.get("layout") == "1 device" and "ops_ms_per_step" in r}
  for r in rows:
    base = single.get(r.get("preset"))
    if base is None or r is base or "ops_ms_per_step" not in r:
      continue
    ops, base_ops = r["ops_ms_per_step"], base["ops_ms_per_step"]
    growth = sorted(((ops.get(n, 0) - base_ops.get(n, 0), n) for n in set(ops) | set(base_ops)), reverse=True)
    print(f"\n{r['preset']} {r['layout']}: GPU ms per step and device, 1 device -> {r['layout']} (largest changes)")
    for delta, name in growth[:count] + growth[-3:]:
      print(f"  {base_ops.get(name, 0):8.3f} -> {ops.get(name, 0):8.3f}  ({delta:+.3f})  {name[:100]}")


def _scaling_brief(row) -> str:
  if "error" in row or "skipped" in row:
    return row.get("error") or f"skipped: {row['skipped']}"
  text = f"{row['tokens_per_s_per_device']:.0f} tok/s/device, {row['step_s'] * 1e3:.1f} ms/step"
  if "efficiency" in row:
    text += f", {row['efficiency']:.0%} of 1 device"
  timeline = row.get("timeline_ms")
  if timeline:
    text += (
      f" | GPU ms/step: compute {timeline['compute']:.1f}, collectives {timeline['collective']:.1f} "
      f"(exposed {timeline['max_exposed_collective']:.1f}), idle {timeline['idle']:.1f}"
    )
  return text


# --- kill and restart ------------------------------------------------------------------------------


def _job_env(index: int, address: str, smoke: bool) -> dict:
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    JAX_COORDINATOR_ADDRESS=address,
    JAX_NUM_PROCESSES="2",
    JAX_PROCESS_ID=str(index),
  )
  if smoke:
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  else:  # one GPU per process; deterministic reductions so that curves compare exactly
    env.update(JAX_LOCAL_DEVICE_IDS=str(index), XLA_FLAGS="--xla_gpu_deterministic_ops=true")
  return env


def _launch(workdir: str, data_dir: str, steps: int, smoke: bool, log) -> list[subprocess.Popen]:
  address = f"localhost:{free_port()}"
  settings = {
    "model.d_model": 64,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "data.seq_len": 64,
    "data.batch_size": 8,
    "train.steps": steps,
    "train.warmup_steps": 5,
    "train.log_every": 1,
    "train.eval_batches": 0,
    "train.checkpoint_every": max(steps // 6, 2),
    "train.keep_checkpoints": 3,
    "train.progress_bar": False,
    "data.data_dir": data_dir,
  }
  command = [
    sys.executable,
    "-m",
    "train",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    *(f"--config.{k}={v}" for k, v in settings.items()),
  ]
  return [
    subprocess.Popen(command, cwd=ROOT, env=_job_env(i, address, smoke), stdout=log, stderr=subprocess.STDOUT)
    for i in range(2)
  ]


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
    subprocess.run(
      [
        sys.executable,
        "-c",
        f"from castle_jax.data.pipeline import get_builder; get_builder('python_stdlib', {data_dir!r})",
      ],
      cwd=ROOT,
      check=True,
      stdout=log,
      stderr=subprocess.STDOUT,
      env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=_job_env(0, "", True)["PYTHONPATH"]),
    )
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
      raise RuntimeError(
        f"the job ended before the kill (exit codes {[j.poll() for j in jobs]}); raise --restart_steps"
      )
    jobs[1].send_signal(signal.SIGKILL)
    row["killed_after_step"] = max((r["step"] for r in _metrics_lines(killed)), default=0)
    # A scheduler ends the whole job when one task dies; give process 0 a few seconds alone.
    row["process0_exit_alone"] = _wait(jobs[:1], 10)[0]
    if jobs[0].poll() is None:
      jobs[0].send_signal(signal.SIGKILL)
      jobs[0].wait()
    row["checkpoints_after_kill"] = sorted(
      int(s) for s in os.listdir(os.path.join(killed, "checkpoints")) if s.isdigit()
    )
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
  # The relaunch's start-up line names the checkpoint it resumed from (its metrics file cannot:
  # the records of the steps it logs again were set aside).
  with open(os.path.join(base, "jobs.log")) as f:
    relaunch_log = f.read().split("==== relaunch after killing", 1)[-1]
  resume_line = re.search(r"resumed from step (\d+)", relaunch_log)
  row.update(
    steps_compared=len(differences),
    max_loss_rel_diff=max(differences, default=None),
    resumed_from_step=int(resume_line[1]) if resume_line else None,
  )
  row["ok"] = len(differences) == steps and max(differences) <= 1e-6
  return row


# --- driver ----------------------------------------------------------------------------------------


def print_table(rows: list[dict]) -> None:
  print("\n| part | what | layout | devices | result | ok |")
  print("| --- | --- | --- | --- | --- | --- |")
  for r in rows:
    if r["part"] == "equivalence":
      what, result = f"{r['attention']} ({r['impl']}, {r.get('dtype', '-')})", _brief(r)
    elif r["part"] == "scaling":
      what, result = r["preset"], _scaling_brief(r)
    else:
      what = r["part"]
      result = r.get("error") or (
        f"killed after step {r['killed_after_step']}, resumed, {r['steps_compared']} steps, "
        f"max loss diff {r['max_loss_rel_diff']:.1e}"
      )
    print(
      f"| {r['part']} | {what} | {r.get('layout', '2 processes')} | {r.get('devices', 2)} | "
      f"{result[:240]} | {'skipped' if 'skipped' in r else 'yes' if r.get('ok') else 'NO'} |"
    )


def main(args) -> int:
  import jax

  start = time.time()
  deadline = start + args.budget_s
  args.out = args.out or fresh_directory(user_cache_dir("multi_gpu"))
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
      rows.append(
        {
          "part": "restart",
          "ok": False,
          "error": f"{type(e).__name__}: {e}"[:800],
          "traceback": traceback.format_exc()[-3000:],
        }
      )
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
        rows.append(
          {
            "part": "equivalence",
            "attention": attention,
            "impl": "-",
            "ok": False,
            "error": "skipped: --budget_s reached",
          }
        )
        continue
      try:
        rows.extend(check_equivalence(attention, n, args.smoke, tuple(args.dtypes.split(","))))
      except Exception as e:  # noqa: BLE001
        rows.append(
          {
            "part": "equivalence",
            "attention": attention,
            "impl": "-",
            "ok": False,
            "error": f"{type(e).__name__}: {e}"[:800],
            "traceback": traceback.format_exc()[-3000:],
          }
        )
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
  if args.profile:
    print_op_growth(rows)
  print_table(rows)
  print(
    f"\n{sum(bool(r.get('ok')) for r in rows)}/{len(rows)} ok in {info['total_s']:.0f} s; "
    f"details in {os.path.join(args.out, 'results.json')}"
  )
  return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main(ARGS))
