"""What the evaluation commands (`python -m castle_jax.eval.<name>`) share: flags and
one-line errors, the trained workdir and its validation text, the results table, the
JSON file and the plot against context length."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, NoReturn, Sequence

import jax
import ml_collections
import numpy as np
import tqdm

from castle_jax import command_line, outputs, sharding
from castle_jax.checkpoints import CheckpointError
from castle_jax.data.pipeline import get_data_source
from castle_jax.data.tokenizer import Tokenizer, load_tokenizer
from castle_jax.models.hf import is_hf_model_dir
from castle_jax.models.pretrained import available_pretrained, load_pretrained
from castle_jax.workdir import TrainedModel, load_trained_model, read_config, tensor_parallel_mesh


class EvalError(command_line.UsageError):
  """A bad flag or an unusable workdir/dataset: printed as one `ERROR: ...` line, exit 1."""


def fail(message: str) -> NoReturn:
  raise EvalError(message)


def make_parser(prog: str, description: str, *, lengths: str | None) -> argparse.ArgumentParser:
  """A parser with the flags every evaluation has (`--workdir` or `--pretrained`, `--step`,
  `--tensor`, `--output`) and, for evaluations of corpus text against context length (`lengths` the
  default), `--lengths` and `--data_dir`; the caller adds its own."""
  parser = command_line.ArgumentParser(prog=prog, description=description)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument(
    "--workdir",
    help="training workdir (config.json, checkpoints/), or a Hugging Face model directory (config.json, "
    "*.safetensors, tokenizer.json: Llama or Qwen2, evaluated on the python_stdlib validation split)",
  )
  source.add_argument(
    "--pretrained",
    choices=available_pretrained(),
    help="a trained model shipped with the package (castle_jax.models.pretrained) instead",
  )
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest good one)")
  parser.add_argument(
    "--tensor",
    type=int,
    default=1,
    help="tensor-parallel degree: shard the model's heads, MLP width and vocabulary over this many devices, "
    "loading the weights straight into their shards (default 1: one device)",
  )
  if lengths is not None:
    parser.add_argument(
      "--lengths", default=lengths, help=f"comma-separated context lengths in tokens (default {lengths})"
    )
  parser.add_argument(
    "--output",
    default=None,
    help="a directory, where each evaluation gets its own <eval>_step<N>.json (then -2, -3, ...)"
    + (" and .png" if lengths is not None else "")
    + ", or a new .json file; default: <workdir>/eval/, or "
    f"{outputs.user_cache_dir('eval', 'NAME')}/ for --pretrained=NAME or a Hugging Face directory NAME",
  )
  if lengths is not None:
    parser.add_argument(
      "--data_dir", default=None, help="TFDS data dir of the validation text (default: the workdir's data.data_dir)"
    )
  return parser


def parse_lengths(text: str, flag: str = "--lengths") -> list[int]:
  """'1024,4096' -> [1024, 4096] (each an integer >= 2), else an EvalError naming `flag`."""
  try:
    lengths = [int(part) for part in text.split(",") if part.strip()]
  except ValueError:
    fail(f"{flag}={text!r} must be comma-separated integers, e.g. {flag}=1024,4096")
  if not lengths or min(lengths) < 2:
    fail(f"{flag}={text!r} must list lengths >= 2 tokens, e.g. {flag}=1024,4096")
  return lengths


def require(ok: bool, flag: str, rule: str, value: Any) -> None:
  if not ok:
    fail(f"{flag} must be {rule}, got {value!r}")


def load(args: argparse.Namespace) -> tuple[TrainedModel, ml_collections.ConfigDict]:
  """The trained model of `--workdir` (at `--step`; or a Hugging Face model directory) or
  `--pretrained`, and its training config (`castle_jax.workdir.read_config`), or an
  EvalError saying what is missing. With `--tensor=N` > 1 the parameters are sharded over
  a mesh of N devices (`castle_jax.workdir.tensor_parallel_mesh`); run the evaluation
  under `on_mesh(params)`."""
  tensor = getattr(args, "tensor", 1)
  if args.pretrained is not None:
    require(args.step is None, "--step", "left out with --pretrained (a shipped model has one step)", args.step)
    require(tensor == 1, "--tensor", "1 with --pretrained (a shipped model loads onto one device)", tensor)
    model, params, config = load_pretrained(args.pretrained)
    return TrainedModel(model, params, load_tokenizer(config.data.tokenizer), config.train.steps), config
  try:
    mesh = tensor_parallel_mesh(tensor)
    return load_trained_model(args.workdir, args.step, mesh=mesh), read_config(args.workdir)
  except (FileNotFoundError, ValueError, CheckpointError) as e:
    fail(str(e))


def on_mesh(params: Any) -> contextlib.AbstractContextManager:
  """The context an evaluation of `params` (from `load`) runs in: the mesh they are sharded
  over set, with the logical axis rules (`castle_jax.sharding.on_mesh`), or nothing when they
  are on one device."""
  placed = jax.tree.leaves(params)[0].sharding
  mesh = placed.mesh if isinstance(placed, jax.sharding.NamedSharding) and placed.mesh.size > 1 else None
  return sharding.on_mesh(mesh)


def evaluated(args: argparse.Namespace) -> str:
  """What was evaluated, for titles and the JSON: the workdir, or `pretrained:<name>`."""
  return args.workdir if args.pretrained is None else f"pretrained:{args.pretrained}"


def default_output_dir(args: argparse.Namespace) -> str:
  """<workdir>/eval, or the user's cache for a shipped model or a Hugging Face model
  directory (a model's files are not written into): never the current directory."""
  if args.pretrained is not None:
    return outputs.user_cache_dir("eval", args.pretrained)
  if is_hf_model_dir(args.workdir):
    return outputs.user_cache_dir("eval", os.path.basename(os.path.abspath(args.workdir)))
  return os.path.join(args.workdir, "eval")


def check_output(args: argparse.Namespace) -> None:
  """Before any work: a `--output` .json file (or its plot) must not exist yet."""
  if args.output and args.output.endswith(".json"):
    outputs.refuse_existing(f"--output={args.output}", args.output, args.output[: -len(".json")] + ".png")


def validation_tokens(
  config: ml_collections.ConfigDict, tokenizer: Tokenizer, count: int, data_dir: str | None = None
) -> np.ndarray:
  """int32 [<= count]: the start of the validation split (config.data.eval_split) as one
  stream of `[BOS] document [EOS]` in file order, as training packs it; fewer tokens
  when the split is shorter. Reads only the documents it needs."""
  d = config.data
  try:
    source = get_data_source(d.dataset, d.eval_split, data_dir or d.data_dir, d.get("source_dir"))
  except ValueError as e:
    fail(f"{e} (the workdir's data settings; --data_dir overrides data.data_dir)")
  pieces, total = [], 0
  for index in range(len(source)):
    text = source[index][d.text_key]
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    pieces.append(np.concatenate([[tokenizer.bos_id], tokenizer.encode(text), [tokenizer.eos_id]]))
    total += pieces[-1].size
    if total >= count:
      break
  return np.concatenate(pieces).astype(np.int32)[:count]


def progress(total: int, description: str, unit: str) -> tqdm.tqdm:
  """A progress bar on stderr (a context manager; `update(n)` as work is done)."""
  return tqdm.tqdm(total=total, desc=description, unit=unit, leave=False, dynamic_ncols=True, file=sys.stderr)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  """A plain-text table: right-aligned columns, floats with 4 decimals."""
  cells = [[f"{v:.4f}" if isinstance(v, float) else str(v) for v in row] for row in rows]
  widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
  line = lambda values: "  ".join(v.rjust(w) for v, w in zip(values, widths))
  return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def output_stem(output: str | None, default_dir: str, name: str, step: int) -> str:
  """The results' path without extension: `output` a .json file, or `<name>_step<step>` in
  the directory `output` (default `default_dir`)."""
  if output and output.endswith(".json"):
    return os.path.abspath(output[: -len(".json")])
  return os.path.abspath(os.path.join(output or default_dir, f"{name}_step{step}"))


def header(name: str, args: argparse.Namespace, config: ml_collections.ConfigDict, step: int) -> dict[str, Any]:
  """The JSON fields every evaluation writes first: what was evaluated."""
  source = {"workdir": os.path.abspath(args.workdir)} if args.pretrained is None else {"pretrained": args.pretrained}
  return {
    "eval": name,
    **source,
    "step": step,
    "family": config.model.family,
    "dataset": config.data.dataset,
    "split": config.data.eval_split,
    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "config": config.to_dict(),
  }


def write_json(path: str, record: dict[str, Any]) -> None:
  with open(path, "w") as f:
    json.dump(record, f, indent=1)


def pyplot():
  """matplotlib.pyplot drawing to files, or None (with a one-line note) when matplotlib, an
  optional extra (`pip install -e .[plot]`), is not installed."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed (pip install -e .[plot]): skipped the plot", file=sys.stderr)
    return None
  return plt


def plot_vs_length(
  path: str,
  lengths: Sequence[int],
  series: dict[str, Sequence[float]],
  *,
  ylabel: str,
  title: str,
  ylim: tuple[float, float] | None = None,
) -> str | None:
  """Plots each series against the context length (log x axis) into `path`; returns
  the path, or None (with a message) when matplotlib is not installed."""
  plt = pyplot()
  if plt is None:
    return None
  figure, axis = plt.subplots(figsize=(6, 4))
  for label, values in series.items():
    axis.plot(lengths, values, marker="o", label=label)
  axis.set_xscale("log", base=2)
  axis.set_xticks(list(lengths), [f"{n:,}" for n in lengths], rotation=30)
  axis.minorticks_off()
  axis.set_xlabel("context length (tokens)")
  axis.set_ylabel(ylabel)
  if ylim is not None:
    axis.set_ylim(*ylim)
  axis.set_title(title, fontsize=10)
  axis.grid(True, alpha=0.3)
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)
  return path


def finish(
  name: str,
  args: argparse.Namespace,
  config: ml_collections.ConfigDict,
  step: int,
  *,
  headers: Sequence[str],
  rows: Sequence[Sequence[Any]],
  record: dict[str, Any],
  lengths: Sequence[int],
  series: dict[str, Sequence[float]],
  ylabel: str,
  title: str,
  ylim: tuple[float, float] | None = None,
) -> None:
  """Prints the table, writes `header(...)` + `record` as JSON and plots `series`
  against `lengths`, under the first free name of `output_stem(...)` (nothing is replaced)."""
  print(format_table(headers, rows))
  content = {**header(name, args, config, step), **record}
  stem = outputs.publish(
    lambda path: write_json(path, content),
    output_stem(args.output, default_output_dir(args), name, step),
    ".json",
    beside=(".png",),
  )
  plotted = plot_vs_length(
    stem + ".png", lengths, series, ylabel=ylabel, ylim=ylim, title=f"{title}, {evaluated(args)} step {step}"
  )
  print(f"wrote {stem}.json" + (f" and {plotted}" if plotted else ""))


def run_main(main, argv: Sequence[str] | None) -> int:
  """Runs `main(argv)`; a bad flag or an unusable workdir becomes one `ERROR: ...` line on
  stderr and exit status 1 (`--traceback`: the full traceback)."""
  return command_line.run(main, argv)
