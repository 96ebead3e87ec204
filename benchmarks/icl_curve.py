"""In-context-learning curves: loss vs position in context of trained checkpoints, per seed and per arm.

    python -m benchmarks.icl_curve --workdirs=runs/icl_power,runs/icl_swa,runs/icl_mha \
        [--seq_len=4096] [--max_docs=64] [--step=N|common] [--early=START,STOP] [--late=START,STOP] \
        [--output=DIR/icl_curve]
    python -m benchmarks.icl_curve --from_json=DIR/icl_curve.json [--output=DIR/again]   # re-summarize, re-plot

Each workdir (an arm) is either one `python -m train` run (config.json + checkpoints) or a run of
several seeds (`--config.train.seeds=N`: seeds.json, seed k in <workdir>/seed_<k>/); all arms are
of the same kind. The evaluation text is document-aligned: the first seq_len + 1 tokens ([BOS] +
document) of every document of the eval split that has that many, so position t has exactly t
tokens of its own document as context (the training pipeline packs documents, which would mix
contexts). Every run is evaluated on the same documents (an error says which runs would not be).

Per run: the mean NLL per position over the documents, binned with exponentially growing bins
(equal width on a log axis, as the power-attention paper's Appendix D does), and the in-context
learning gain `late - early`: the mean loss over positions [--late) minus over [--early) (default
[seq_len/2, seq_len) and [seq_len/16, seq_len/8), i.e. 4096-8192 and 512-1024 at 8192 tokens;
negative when the loss keeps falling with more context). Per arm: each bin's mean over the seeds
and its 95% interval (t distribution, n - 1 degrees of freedom; none for one seed), the same for
the gain, and for every later arm the gain's difference to the first arm, paired by seed index
(`castle_jax.eval.compare.paired_difference`; seed k of every arm read the same data in the same
order).

`--step=common` evaluates every run at the newest checkpoint step that all of them have (arms
stopped by a time limit at different steps are then compared at equal training tokens);
`--step=N` at step N; default: each run's newest. SIGTERM (a time limit) stops the evaluation
after the run in flight and writes what was evaluated (seeds are evaluated in the order seed 0 of
every arm, then seed 1, ..., so a partial result keeps the arms balanced).

Writes `<output>.json` (per position and per bin for every run, the statistics), `<output>.csv`
(per bin: each arm's mean, with its interval for arms of several seeds) and `<output>.png` (loss
vs position with a 95% band per arm, and the gain per arm) when matplotlib is installed
(`pip install -e .[plot]`). Default output: a new folder under ~/.cache/castle_jax/icl_curve/; a
named --output whose files exist is refused. Bad input (a missing or mixed workdir, a step no run
has, a position range outside the context) is one error line naming the flag.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import signal
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import flags, logging

from castle_jax.checkpoints import CheckpointError
from castle_jax.command_line import UsageError, own_flags_parser, run_absl
from castle_jax.data.pipeline import get_data_source
from castle_jax.eval import cli
from castle_jax.eval.common_step import checkpoint_steps, common_checkpoint_step
from castle_jax.eval.compare import LEVEL, mean_interval, paired_difference
from castle_jax.outputs import fresh_directory, refuse_existing, user_cache_dir
from castle_jax.workdir import (
  CONFIG_NAME,
  load_trained_model,
  saved_config,
  seed_workdir,
  seeds_record,
)

# This command's own flags: other absl commands define --step, --split and --output too, and a
# process (a test run) may import several.
FLAGS = flags.FlagValues()
_WORKDIRS = flags.DEFINE_list(
  "workdirs", None, "Training workdirs (arms) to compare; the first is the base.", flag_values=FLAGS
)
_SEQ_LEN = flags.DEFINE_integer(
  "seq_len", None, "Context length (default: the runs' data.seq_len).", lower_bound=2, flag_values=FLAGS
)
_MAX_DOCS = flags.DEFINE_integer(
  "max_docs", 64, "Evaluate at most this many documents.", lower_bound=1, flag_values=FLAGS
)
_SPLIT = flags.DEFINE_string("split", None, "Split to read (default: each run's data.eval_split).", flag_values=FLAGS)
_BINS_PER_OCTAVE = flags.DEFINE_integer(
  "bins_per_octave", 2, "Bins per doubling of the position.", lower_bound=1, flag_values=FLAGS
)
_STEP = flags.DEFINE_string(
  "step",
  None,
  "Checkpoint step of every run: N, or 'common' (the newest step all runs have); default: each newest.",
  flag_values=FLAGS,
)
_EARLY = flags.DEFINE_string(
  "early", None, "START,STOP: positions of the early loss (default seq_len/16,seq_len/8).", flag_values=FLAGS
)
_LATE = flags.DEFINE_string(
  "late", None, "START,STOP: positions of the late loss (default seq_len/2,seq_len).", flag_values=FLAGS
)
_FROM_JSON = flags.DEFINE_string(
  "from_json", None, "Re-summarize and re-plot an earlier <output>.json instead.", flag_values=FLAGS
)
_OUTPUT = flags.DEFINE_string(
  "output",
  None,
  "Output path without extension (default: a new folder in the user cache); must not exist yet.",
  flag_values=FLAGS,
)

SUFFIXES = (".json", ".csv", ".png")


class _Stopped(Exception):
  """SIGTERM arrived: write what was evaluated."""


# --- the evaluation ----------------------------------------------------------------------------------


def document_windows(data_config, tokenizer, seq_len: int, max_docs: int, split: str) -> np.ndarray:
  """int32 [docs, seq_len + 1]: the first seq_len + 1 tokens of each long-enough document."""
  source = get_data_source(data_config.dataset, split, data_config.data_dir, data_config.get("source_dir"))
  windows = []
  for index in range(len(source)):
    text = source[index][data_config.text_key]
    text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
    tokens = np.concatenate([[tokenizer.bos_id], tokenizer.encode(text)])
    if len(tokens) >= seq_len + 1:
      windows.append(tokens[: seq_len + 1])
    if len(windows) == max_docs:
      break
  if not windows:
    raise UsageError(f"--seq_len={seq_len}: no document of split {split!r} has {seq_len + 1} tokens; lower it")
  return np.stack(windows).astype(np.int32)


def make_nll(model):
  """A jitted fn(params, tokens int32 [B, T + 1]) -> float32 [B, T]: the NLL (nats) of token t + 1
  given tokens 0..t. One per model structure, so seeds of an arm share one compilation."""

  @jax.jit
  def nll(params, tokens):
    logits, _ = model.apply({"params": params}, tokens[:, :-1])
    logits = logits.astype(jnp.float32)
    targets = tokens[:, 1:]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]

  return nll


def per_position_loss(model, params, windows: np.ndarray, batch_size: int = 1, nll=None) -> np.ndarray:
  """float64 [seq_len]: mean NLL (nats) over the documents of predicting token t + 1 from tokens 0..t.

  windows: int32 [docs, seq_len + 1]; nll: `make_nll(model)` (made here when None)."""
  nll = nll or make_nll(model)
  total = np.zeros(windows.shape[1] - 1)
  for start in range(0, len(windows), batch_size):
    total += np.asarray(nll(params, windows[start : start + batch_size]), np.float64).sum(0)
  return total / len(windows)


def log_bins(length: int, per_octave: int) -> list[tuple[int, int]]:
  """[(start, stop)) position bins whose widths grow geometrically, covering 0..length-1."""
  edges = sorted(
    {0, length} | {int(round(2 ** (i / per_octave))) for i in range(int(np.log2(length) * per_octave) + 1)}
  )
  return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if a < length]


# --- arms, runs and their settings ------------------------------------------------------------------


def default_ranges(seq_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
  """(early, late) position ranges [start, stop): [L/16, L/8) and [L/2, L)."""
  return (seq_len // 16, max(seq_len // 8, seq_len // 16 + 1)), (seq_len // 2, seq_len)


def parse_range(flag: str, text: str | None, seq_len: int, default: tuple[int, int]) -> tuple[int, int]:
  """A [start, stop) position range from 'START,STOP'; UsageError unless 0 <= start < stop <= seq_len."""
  if text is None:
    start, stop = default
  else:
    parts = text.split(",")
    try:
      start, stop = (int(p) for p in parts)
    except ValueError:
      raise UsageError(f"--{flag}={text}: expected two integers START,STOP (positions [START, STOP))") from None
  if not 0 <= start < stop <= seq_len:
    raise UsageError(
      f"--{flag}={start},{stop}: positions must satisfy 0 <= START < STOP <= seq_len ({seq_len}) "
      "(the context has positions 0..seq_len-1)"
    )
  return start, stop


def find_runs(workdirs: Sequence[str]) -> dict[str, list[tuple[int | None, str]]]:
  """{arm name: [(seed index or None for a single run, run workdir)]}, in the given order.

  An arm is a single run or a run of several seeds; mixing the two kinds, a directory that is
  neither, a repeated name or a seed without its workdir is a UsageError."""
  arms: dict[str, list[tuple[int | None, str]]] = {}
  kinds = {}
  for workdir in workdirs:
    name = os.path.basename(os.path.normpath(workdir))
    if name in arms:
      raise UsageError(f"--workdirs: two arms are named {name!r} (the folder name); rename one of the folders")
    record = seeds_record(workdir)
    if record is not None:
      count = record.get("seeds")
      if not isinstance(count, int) or count < 1:
        raise UsageError(f"--workdirs: {workdir}/seeds.json records {count!r} seeds: not a run of several seeds")
      runs = [(k, seed_workdir(workdir, k)) for k in range(count)]
      for _, path in runs:
        if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
          raise UsageError(f"--workdirs: {path} has no {CONFIG_NAME}: seed not trained (seeds.json records {count})")
      kinds[workdir] = "seeds"
    elif os.path.isfile(os.path.join(workdir, CONFIG_NAME)):
      runs = [(None, workdir)]
      kinds[workdir] = "single"
    elif not os.path.isdir(workdir):
      raise UsageError(f"--workdirs: {workdir}: no such directory")
    else:
      raise UsageError(
        f"--workdirs: {workdir} is neither a training run ({CONFIG_NAME}) nor a run of several seeds "
        "(seeds.json); pass the workdir given to python -m train"
      )
    arms[name] = runs
  if len(set(kinds.values())) > 1:
    single = next(w for w, kind in kinds.items() if kind == "single")
    several = next(w for w, kind in kinds.items() if kind == "seeds")
    raise UsageError(
      f"--workdirs: {single} holds a single run but {several} a run of several seeds: pass arms of one kind "
      "(train every arm with the same --config.train.seeds=N)"
    )
  return arms


def run_name(arm: str, seed: int | None) -> str:
  return arm if seed is None else f"{arm}/seed_{seed}"


def choose_steps(runs: dict[str, str], step: str | None) -> dict[str, int | None]:
  """{run name: the step to evaluate (None: its newest)} for --step (None, 'common' or an int)."""
  if step is None:
    return dict.fromkeys(runs)
  if step != "common":
    try:
      number = int(step)
    except ValueError:
      raise UsageError(f"--step={step}: expected a checkpoint step (an integer) or 'common'") from None
    for name, workdir in runs.items():
      steps = checkpoint_steps(workdir)
      if number not in steps:
        raise UsageError(f"--step={step}: {name} ({workdir}) has no checkpoint of step {number}; it has {steps}")
    return dict.fromkeys(runs, number)
  try:
    return dict.fromkeys(runs, common_checkpoint_step(runs))
  except UsageError as e:
    raise UsageError(f"--step=common: {e}") from None


# --- statistics and output --------------------------------------------------------------------------


def run_summary(loss: np.ndarray, bins, early: tuple[int, int], late: tuple[int, int]) -> dict[str, Any]:
  """A run's binned loss, early and late mean loss and the gain `late - early`. loss: [seq_len]."""
  early_loss = float(loss[early[0] : early[1]].mean())
  late_loss = float(loss[late[0] : late[1]].mean())
  return {
    "binned_loss": [float(loss[a:b].mean()) for a, b in bins],
    "early_loss": early_loss,
    "late_loss": late_loss,
    "late_minus_early": late_loss - early_loss,
  }


def arm_statistics(arm_runs: list[dict[str, Any]], bins) -> dict[str, Any]:
  """Mean and 95% interval over an arm's runs (seeds) of every bin, the early and late loss and the gain."""
  binned = [mean_interval([run["binned_loss"][i] for run in arm_runs]) for i in range(len(bins))]
  return {
    "seeds": [run["seed"] for run in arm_runs],
    "steps": sorted({run["step"] for run in arm_runs}),
    "binned": {key: [b[key] for b in binned] for key in ("mean", "low", "high")},
    **{key: mean_interval([run[key] for run in arm_runs]) for key in ("early_loss", "late_loss", "late_minus_early")},
  }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
  """Adds to `result` ({"bins", "early", "late", "runs": {name: run}}) every run's summary and
  "arms": each arm's statistics and, for later arms, the gain's paired difference to the first."""
  bins, early, late = result["bins"], tuple(result["early"]), tuple(result["late"])
  for run in result["runs"].values():
    run.update(run_summary(np.asarray(run["loss"]), bins, early, late))
  arms: dict[str, Any] = {}
  for run in result["runs"].values():
    arms.setdefault(run["arm"], []).append(run)
  statistics = {name: arm_statistics(runs, bins) for name, runs in arms.items()}
  names = list(arms)
  base = {run["seed"]: run["late_minus_early"] for run in arms[names[0]]}
  for name in names[1:]:
    other = {run["seed"]: run["late_minus_early"] for run in arms[name]}
    if None not in base and None not in other:
      statistics[name]["gain_vs_first"] = {"base": names[0], **paired_difference(base, other)}
  result["arms"] = statistics
  return result


def _number(value: float | None, digits: int = 3, sign: bool = False) -> str:
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return "-"
  return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _interval(summary: dict[str, Any], sign: bool = False) -> str:
  text = _number(summary["mean"], sign=sign)
  if summary.get("low") is not None:
    text += f" [{_number(summary['low'], sign=sign)}, {_number(summary['high'], sign=sign)}]"
  return text


def format_table(result: dict[str, Any]) -> str:
  """The per-arm table: seeds, step, early and late loss and the gain with 95% intervals."""
  early, late = result["early"], result["late"]
  names = list(result["arms"])
  lines = [
    f"late - early: mean loss (nats/token) over positions [{late[0]}, {late[1]}) minus over "
    f"[{early[0]}, {early[1]}); mean and {LEVEL:.0%} interval over seeds; {result['documents']} documents x "
    f"{result['seq_len']} tokens",
    f"{'arm':12s} {'seeds':>5s} {'step':>6s}  {'early loss':26s} {'late loss':26s} {'late - early':28s} "
    f"minus {names[0]}'s, paired by seed",
  ]
  for name, arm in result["arms"].items():
    steps = ",".join(str(s) for s in arm["steps"])
    line = (
      f"{name:12s} {len(arm['seeds']):5d} {steps:>6s}  {_interval(arm['early_loss']):26s} "
      f"{_interval(arm['late_loss']):26s} {_interval(arm['late_minus_early'], sign=True):28s}"
    )
    versus = arm.get("gain_vs_first")
    if versus is not None:
      line += f" {_interval(versus, sign=True)}"
      if versus.get("p") is not None:
        line += f", t = {versus['t']:.2f}, p = {versus['p']:.3f}"
    lines.append(line)
  return "\n".join(lines)


def write_csv(path: str, result: dict[str, Any]) -> None:
  """Per bin: each arm's mean (and for arms of several seeds its interval's low and high)."""
  arms = result["arms"]
  with_interval = {name: len(arm["seeds"]) > 1 for name, arm in arms.items()}
  header = ["bin_start", "bin_stop"]
  for name in arms:
    header += [name, f"{name}_low", f"{name}_high"] if with_interval[name] else [name]
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    for i, (a, b) in enumerate(result["bins"]):
      row = [a, b]
      for name, arm in arms.items():
        keys = ("mean", "low", "high") if with_interval[name] else ("mean",)
        row += [_number(arm["binned"][key][i], 5) for key in keys]
      writer.writerow(row)


def plot(path: str, result: dict[str, Any]) -> str | None:
  """Loss vs position (log x; mean and 95% band per arm, thin lines per seed) beside the gain per arm."""
  plt = cli.pyplot()
  if plt is None:
    return None
  figure, (curves, gains) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
  centers = [math.sqrt(max(a, 1) * b) for a, b in result["bins"]]
  for index, (name, arm) in enumerate(result["arms"].items()):
    color = f"C{index}"
    label = f"{name} ({len(arm['seeds'])} seed{'s' if len(arm['seeds']) > 1 else ''})"
    curves.plot(centers, arm["binned"]["mean"], color=color, marker="o", markersize=3, label=label)
    if len(arm["seeds"]) > 1:
      # A loss is never negative; the t band of a few seeds over the first few tokens can be.
      low = [max(value, 0.0) for value in arm["binned"]["low"]]
      curves.fill_between(centers, low, arm["binned"]["high"], color=color, alpha=0.2)
      for run in result["runs"].values():
        if run["arm"] == name:
          curves.plot(centers, run["binned_loss"], color=color, linewidth=0.6, alpha=0.4)
    gain = arm["late_minus_early"]
    error = None if gain["low"] is None else [[gain["mean"] - gain["low"]], [gain["high"] - gain["mean"]]]
    gains.bar(index, gain["mean"], color=color, alpha=0.7, yerr=error, capsize=4)
  for key, shade in (("early", "0.85"), ("late", "0.92")):
    start, stop = result[key]
    curves.axvspan(max(start, 0.5), stop, color=shade, zorder=0, label=f"{key} positions [{start}, {stop})")
  curves.set_xscale("log")
  # The means set the scale: the bands of the first tokens (few samples, 2-3 seeds) would flatten the curves.
  top = max(max(arm["binned"]["mean"]) for arm in result["arms"].values())
  curves.set_ylim(0, 1.1 * top)
  curves.set_xlabel("position in context (tokens)")
  curves.set_ylabel("loss (nats / token)")
  curves.grid(True, which="both", alpha=0.3)
  curves.legend(fontsize=8)
  gains.axhline(0, color="black", linewidth=0.8)
  gains.set_xticks(range(len(result["arms"])), list(result["arms"]), fontsize=8)
  early, late = result["early"], result["late"]
  gains.set_ylabel(f"loss [{late[0]}, {late[1]}) - loss [{early[0]}, {early[1]})")
  gains.grid(True, axis="y", alpha=0.3)
  figure.suptitle(f"In-context learning curves: mean and {LEVEL:.0%} interval over seeds", fontsize=10)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)
  return path


def write_outputs(output: str, result: dict[str, Any]) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  with open(output + ".json", "w") as f:
    json.dump(result, f)
  write_csv(output + ".csv", result)
  print(f"wrote {output}.json and {output}.csv", flush=True)
  if plot(output + ".png", result):
    print(f"wrote {output}.png", flush=True)


# --- the command ------------------------------------------------------------------------------------


def _evaluate(arms: dict[str, list[tuple[int | None, str]]]) -> dict[str, Any]:
  """Evaluates every run (seed 0 of every arm, then seed 1, ...); returns the result before `summarize`."""
  runs = {run_name(arm, seed): path for arm, seeds in arms.items() for seed, path in seeds}
  configs = {name: saved_config(path) for name, path in runs.items()}
  seq_lens = {name: _SEQ_LEN.value or config["data"]["seq_len"] for name, config in configs.items()}
  if len(set(seq_lens.values())) > 1:
    listed = ", ".join(f"{name}: {length}" for name, length in seq_lens.items())
    raise UsageError(f"--seq_len: the runs were trained at different lengths ({listed}); pass one --seq_len")
  seq_len = next(iter(seq_lens.values()))
  early_default, late_default = default_ranges(seq_len)
  early = parse_range("early", _EARLY.value, seq_len, early_default)
  late = parse_range("late", _LATE.value, seq_len, late_default)
  steps = choose_steps(runs, _STEP.value)
  order = sorted(
    ((arm, seed, path) for arm, seeds in arms.items() for seed, path in seeds),
    key=lambda item: (item[1] or 0, list(arms).index(item[0])),
  )
  result: dict[str, Any] = {
    "seq_len": seq_len,
    "bins": log_bins(seq_len, _BINS_PER_OCTAVE.value),
    "early": list(early),
    "late": list(late),
    "step": _STEP.value or "newest",
    "complete": False,
    "runs": {},
  }
  windows_by_data: dict[str, np.ndarray] = {}
  first_documents = None
  compiled: dict[str, Any] = {}

  def stop(signum, frame):
    del signum, frame
    raise _Stopped

  previous = signal.signal(signal.SIGTERM, stop)
  try:
    for arm, seed, path in order:
      name = run_name(arm, seed)
      try:
        model, params, tokenizer, step = load_trained_model(path, steps[name])
      except (FileNotFoundError, ValueError, CheckpointError) as e:
        raise UsageError(f"--workdirs: {e}") from e
      config = configs[name]
      data = config["data"]
      split = _SPLIT.value or data["eval_split"]
      key = json.dumps([data["dataset"], data.get("source_dir"), data["tokenizer"], split, seq_len])
      if key not in windows_by_data:
        windows_by_data[key] = document_windows(
          ml_collections.ConfigDict(data), tokenizer, seq_len, _MAX_DOCS.value, split
        )
      windows = windows_by_data[key]
      documents = hashlib.sha256(windows.tobytes()).hexdigest()
      if first_documents is None:
        first_documents = (name, documents)
      elif documents != first_documents[1]:
        raise UsageError(
          f"--workdirs: {name} and {first_documents[0]} would be evaluated on different documents "
          "(their data.dataset, data.source_dir, data.tokenizer or eval split differ): their curves do not compare"
        )
      model_key = json.dumps(config["model"], sort_keys=True)
      if model_key not in compiled:
        compiled[model_key] = make_nll(model)
      losses = per_position_loss(model, params, windows, nll=compiled[model_key])
      model_config = config["model"]
      result["runs"][name] = {
        "arm": arm,
        "seed": seed,
        "workdir": path,
        "step": step,
        "documents": len(windows),
        "seq_len": seq_len,
        "attention": model_config["attention"],
        "attention_impl": model_config.get("attention_impl"),
        "sliding_window": model_config["sliding_window"],
        "attention_kwargs": model_config.get("attention_kwargs", {}),
        "loss": [round(x, 5) for x in losses.tolist()],
      }
      result["documents"] = len(windows)
      print(
        f"{name}: step {step}, {len(windows)} documents x {seq_len} tokens, mean loss {losses.mean():.4f}, "
        f"late - early {losses[late[0] : late[1]].mean() - losses[early[0] : early[1]].mean():+.4f}",
        flush=True,
      )
    result["complete"] = True
  except _Stopped:
    evaluated = len(result["runs"])
    if not evaluated:
      raise UsageError("stopped by SIGTERM before any run was evaluated: nothing to write") from None
    print(f"stopped by SIGTERM: writing the {evaluated} of {len(order)} runs evaluated", flush=True)
  finally:
    signal.signal(signal.SIGTERM, previous)
  return result


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if _FROM_JSON.value and _WORKDIRS.value:
    raise UsageError("--from_json and --workdirs exclude each other: re-plot an earlier result or evaluate runs")
  if not _WORKDIRS.value and not _FROM_JSON.value:
    raise UsageError("--workdirs is required: the training workdirs to compare, e.g. --workdirs=runs/a,runs/b")
  if _OUTPUT.value:
    output = _OUTPUT.value
    refuse_existing(f"--output={output}", *(output + suffix for suffix in SUFFIXES))
  else:
    output = os.path.join(fresh_directory(user_cache_dir("icl_curve")), "icl_curve")
  if _FROM_JSON.value:
    try:
      with open(_FROM_JSON.value) as f:
        result = json.load(f)
      result = {
        key: result[key] for key in ("seq_len", "bins", "early", "late", "step", "complete", "documents", "runs")
      }
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise UsageError(f"--from_json={_FROM_JSON.value}: not a result file of this command ({e})") from None
    summarize(result)
    write_outputs(output, result)
    print(format_table(result), flush=True)
    return
  previous = signal.getsignal(signal.SIGTERM)
  try:
    result = _evaluate(find_runs(_WORKDIRS.value))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a signal now would leave half-written files
    summarize(result)
    write_outputs(output, result)
  finally:
    signal.signal(signal.SIGTERM, previous)
  print(format_table(result), flush=True)


if __name__ == "__main__":
  run_absl(main, flags_parser=own_flags_parser(FLAGS))
