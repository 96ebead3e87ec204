"""Compares the arms of an experiment: runs of several seeds (`--config.train.seeds=N`) of
different configs, evaluated on the same data.

    python -m castle_jax.eval.compare runs/baseline runs/castle [runs/C ...] [--metric=eval_loss]
        [--at_tokens=N] [--at_seconds=S] [--results=metrics|perplexity|passkey|tasks --length=L]
        [--bucket=MEASURE:LABEL] [--unpaired] [--output=DIR]

Each arm is the workdir of a run of several seeds; seed k is read from `<arm>/seed_<k>/`. The
values compared are each seed's evaluations: by default the eval records of its
metrics.jsonl (`--metric` eval_loss, perplexity or bits_per_byte), or with `--results` the
results files of an evaluation command in `<arm>/seed_<k>/eval/` (perplexity: `--metric`
eval_loss, perplexity or bits_per_byte at context `--length`; passkey: first_token or
all_tokens accuracy at `--length`; tasks: query_accuracy, token_accuracy or answer_loss of
`castle_jax.eval.tasks`, overall, or in one bucket of a measure with `--bucket`, e.g.
`--bucket=order:0`: MQAR's first queries, which elimination cannot answer). For each arm: the mean over its seeds and its 95%
interval (t distribution). For each later arm: the difference to the first arm, paired by
seed index (seed k of every arm read the same data in the same order and is evaluated on the
same data: `train.seeds` gives seed k the same seeds in every config): its mean, 95%
interval, the paired t test (statistic, two-sided p) and, from 6 pairs on (fewer can never
reach p < 0.05), the Wilcoxon signed-rank p.

Two comparisons:
  equal tokens: at the same number of training tokens (step x data.batch_size x data.seq_len):
    the last evaluation every seed of every arm has, or `--at_tokens`;
  equal time: at the same training time after the first step (`elapsed_s` of the records,
    wall-clock seconds of training with evaluation left out, less that of step 1, which holds
    the compilation: in a short run, compile times that differ between arms, or between a
    fresh compile and a cached one, would otherwise decide it), each seed's evaluations
    interpolated linearly: at the time every seed has reached, or `--at_seconds`. Times
    compare only runs on the same kind of device, trained the same way (a note says when the
    arms' seeds ran differently).

Arms must be evaluated on the same data (the same dataset, eval split, tokenizer, sequence
length, batch size, eval batches and task) and, for pairs, read the same data order for the
same seed index; otherwise the command names the arms and the settings that differ.
`--unpaired` compares arms without common seeds or data order by Welch's t test instead.

Writes `compare_<metric>.json` (every value, seed by seed, and the statistics) and a `.png`
(the metric against tokens and against training time, mean and 95% band per arm; needs
matplotlib) into `--output` (default `<first arm>/compare/`; a later comparison writes
`compare_<metric>-2.json` and so on: no result is replaced), then prints notes and, last, the tables.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import sys
import time
from typing import Any, Sequence

import numpy as np
from scipy import stats

from castle_jax import command_line, outputs
from castle_jax.checkpoints import file_sha256
from castle_jax.eval import cli
from castle_jax.workdir import CONFIG_NAME, resolve_tokenizer_path, saved_config, seed_workdir, seeds_record

LEVEL = 0.95
# The exact two-sided Wilcoxon signed-rank test cannot reach p < 0.05 with fewer pairs
# (its smallest p with 5 pairs is 2 / 2^5 = 0.0625).
WILCOXON_MIN_PAIRS = 6
SOURCES = ("metrics", "perplexity", "passkey", "tasks")
# Evaluations whose results are one row per context length (`--length` picks one).
_BY_LENGTH = ("perplexity", "passkey")
METRICS = {
  "metrics": {"eval_loss": "loss", "perplexity": "perplexity", "bits_per_byte": "bits_per_byte"},
  "perplexity": {"eval_loss": "loss", "perplexity": "perplexity", "bits_per_byte": "bits_per_byte"},
  "passkey": {"all_tokens": "all_tokens", "first_token": "first_token"},
  "tasks": {"query_accuracy": "query_accuracy", "token_accuracy": "token_accuracy", "answer_loss": "answer_loss"},
}
DEFAULT_METRIC = {"metrics": "eval_loss", "perplexity": "eval_loss", "passkey": "all_tokens", "tasks": "query_accuracy"}
# data.* settings that change neither the evaluation data nor the data order.
_DATA_KEYS_IGNORED = ("data_dir", "worker_count", "prefetch")
# data.* settings that change the training data order but not the evaluation data.
_DATA_ORDER_KEYS = ("shuffle_seed", "train_split")
# What the results file of an evaluation command says about the data it evaluated on.
_RESULTS_EVAL_SET = {
  "perplexity": ("windows",),
  "passkey": ("examples", "digits", "seed", "depths", "align_to", "top_k"),
  "tasks": ("task", "knobs", "examples", "seed"),
}


class CompareError(command_line.UsageError):
  """Arms that cannot be compared, or a bad flag: one line naming them and the fix."""


@dataclasses.dataclass
class Point:
  """One evaluation of one seed."""

  step: int
  tokens: int
  seconds: float | None  # training time at that step after the first (`elapsed_s`); None: not recorded
  value: float


@dataclasses.dataclass
class Arm:
  name: str  # as given on the command line
  workdir: str
  seeds: dict[int, list[Point]]  # seed index -> its evaluations, by step
  configs: dict[int, dict[str, Any]]  # seed index -> its config.json
  eval_set: dict[str, Any]  # what defines the data it is evaluated on
  count: int  # seeds trained (seeds.json), with or without evaluations yet
  seeds_mode: str | None


# --- statistics ------------------------------------------------------------------------------------


def mean_interval(values: Sequence[float]) -> dict[str, Any]:
  """{"n", "mean", "sd", "low", "high"}: the mean and its 95% interval from the t distribution
  with n - 1 degrees of freedom (sd with n - 1; no sd or interval for one value)."""
  n = len(values)
  mean = math.fsum(values) / n
  if n < 2:
    return {"n": n, "mean": mean, "sd": None, "low": None, "high": None}
  sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
  half = stats.t.ppf((1 + LEVEL) / 2, n - 1) * sd / math.sqrt(n)
  return {"n": n, "mean": mean, "sd": sd, "low": mean - half, "high": mean + half}


def _t_test(mean: float, standard_error: float, degrees: float) -> tuple[float, float]:
  """(t, two-sided p) of a mean against 0."""
  if standard_error == 0:
    return (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
  t = mean / standard_error
  return t, float(2 * stats.t.sf(abs(t), degrees))


def paired_difference(base: dict[int, float], other: dict[int, float]) -> dict[str, Any]:
  """`other` - `base` over their common seed indices: the mean difference and its 95%
  interval, the paired t test (t, two-sided p) and, from WILCOXON_MIN_PAIRS pairs on, the
  two-sided Wilcoxon signed-rank p (exact for small samples without ties; zeros dropped)."""
  seeds = sorted(set(base) & set(other))
  differences = [other[k] - base[k] for k in seeds]
  result = {"kind": "paired", "seeds": seeds, **mean_interval(differences), "t": None, "p": None, "wilcoxon_p": None}
  n = len(differences)
  if n >= 2:
    result["t"], result["p"] = _t_test(result["mean"], result["sd"] / math.sqrt(n), n - 1)
  if n >= WILCOXON_MIN_PAIRS:
    nonzero = [d for d in differences if d != 0]
    result["wilcoxon_p"] = float(stats.wilcoxon(nonzero).pvalue) if nonzero else 1.0
  return result


def unpaired_difference(base: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
  """mean(other) - mean(base) with its 95% interval and Welch's t test (unequal variances,
  Welch-Satterthwaite degrees of freedom); needs two values per arm."""
  a, b = mean_interval(base), mean_interval(other)
  result = {"kind": "unpaired (Welch)", "n": [a["n"], b["n"]], "mean": b["mean"] - a["mean"]}
  result.update(low=None, high=None, t=None, p=None, wilcoxon_p=None, seeds=None)
  if a["n"] < 2 or b["n"] < 2:
    return result
  va, vb = a["sd"] ** 2 / a["n"], b["sd"] ** 2 / b["n"]
  standard_error = math.sqrt(va + vb)
  degrees = (va + vb) ** 2 / (va**2 / (a["n"] - 1) + vb**2 / (b["n"] - 1)) if standard_error else 1.0
  half = stats.t.ppf((1 + LEVEL) / 2, degrees) * standard_error
  result.update(low=result["mean"] - half, high=result["mean"] + half, degrees=degrees)
  result["t"], result["p"] = _t_test(result["mean"], standard_error, degrees)
  return result


def value_at(points: Sequence[Point], seconds: float) -> float | None:
  """A seed's metric at training time `seconds`, linear between its evaluations; None
  outside them or without times."""
  timed = sorted((p.seconds, p.value) for p in points if p.seconds is not None)
  if not timed or not timed[0][0] <= seconds <= timed[-1][0]:
    return None
  times, values = zip(*timed)
  return float(np.interp(seconds, times, values))


# --- reading the arms -------------------------------------------------------------------------------


def _tokenizer_identity(seed_dir: str, tokenizer: str) -> str:
  if tokenizer == "byte":
    return "byte"
  path = resolve_tokenizer_path(seed_dir, tokenizer)
  return f"sha256:{file_sha256(path)}" if os.path.isfile(path) else tokenizer


def _eval_set(config: dict[str, Any], seed_dir: str) -> dict[str, Any]:
  """The settings that define the data a seed is evaluated on."""
  data = {
    f"data.{key}": value for key, value in config["data"].items() if key not in _DATA_KEYS_IGNORED + _DATA_ORDER_KEYS
  }
  data["data.tokenizer"] = _tokenizer_identity(seed_dir, config["data"]["tokenizer"])
  return {**data, "train.eval_batches": config["train"]["eval_batches"]}


def _arm_error(workdir: str) -> str | None:
  """Why `workdir` is not an arm (a run of several seeds), or None."""
  if not os.path.isdir(workdir):
    return f"{workdir}: no such directory"
  if seeds_record(workdir) is not None:
    return None
  if os.path.isfile(os.path.join(workdir, CONFIG_NAME)):
    return (
      f"{workdir} holds a single run, not a run of several seeds: each arm must be trained with "
      "--config.train.seeds=N (N >= 2)"
    )
  if not os.listdir(workdir):
    return f"{workdir} is empty: each arm must be the workdir of a run with --config.train.seeds=N"
  return f"{workdir} is not a run of several seeds (no seeds.json): train each arm with --config.train.seeds=N"


def _records(seed_dir: str, split: str) -> dict[int, dict[str, Any]]:
  """{step: record} of the seed's metrics.jsonl records of `split` (none without the file)."""
  path = os.path.join(seed_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return {r["step"]: r for r in sorted(records, key=lambda r: r["step"]) if r.get("split") == split}


def _after_first_step(seconds: float | None, train_seconds: dict[int, float]) -> float | None:
  """`seconds` (an elapsed_s) counted from the end of step 1, the step that compiles the
  training program (`train_seconds`: `_train_seconds`; from the start without step 1's)."""
  return None if seconds is None else seconds - train_seconds.get(1, 0.0)


def _points_from_metrics(seed_dir: str, key: str, tokens_per_step: int) -> list[Point]:
  train_seconds = _train_seconds(seed_dir)
  return [
    Point(step, step * tokens_per_step, _after_first_step(record.get("elapsed_s"), train_seconds), float(record[key]))
    for step, record in _records(seed_dir, "eval").items()
    if key in record
  ]


def _train_seconds(seed_dir: str) -> dict[int, float]:
  """{step: elapsed_s} of the seed's train records."""
  return {step: r["elapsed_s"] for step, r in _records(seed_dir, "train").items() if "elapsed_s" in r}


def _points_from_results(
  seed_dir: str, source: str, key: str, length: int | None, tokens_per_step: int, bucket: tuple[str, str] | None = None
) -> tuple[list[Point], dict[str, Any], int]:
  """The seed's evaluations in its `<source>_step<N>*.json` files (`tasks_<task>_step<N>*.json`
  for the mechanism tasks; the newest file of each step), what defines their data, and the
  length read (None for the tasks). `bucket` (measure, label): the tasks' row of that bucket
  instead of the overall one."""
  by_step = {}
  pattern = "tasks_*_step*.json" if source == "tasks" else f"{source}_step*.json"
  for path in glob.glob(os.path.join(seed_dir, "eval", pattern)):
    with open(path) as f:
      record = json.load(f)
    if record.get("eval") == source and (
      record["step"] not in by_step or record["time"] > by_step[record["step"]]["time"]
    ):
      by_step[record["step"]] = record
  if not by_step:
    return [], {}, length
  seconds = _train_seconds(seed_dir)
  points, eval_set = [], {}
  for step in sorted(by_step):
    record = by_step[step]
    if source in _BY_LENGTH:
      rows = {row["length"]: row for row in record["results"]}
      chosen = length if length is not None else max(rows)
      if chosen not in rows:
        raise CompareError(
          f"--length={chosen}: {source} results of step {step} in {seed_dir}/eval have lengths {sorted(rows)} only"
        )
      length, row = chosen, rows[chosen]
    elif bucket is not None:
      row = _bucket_row(record, bucket, seed_dir, step)
    else:
      row = record["overall"]
    points.append(Point(step, step * tokens_per_step, _after_first_step(seconds.get(step), seconds), float(row[key])))
    settings = {f"{source} {name}": record.get(name) for name in _RESULTS_EVAL_SET[source]}
    if eval_set and settings != eval_set:
      raise CompareError(
        f"the {source} results of {seed_dir} are not all of the same evaluation: {'; '.join(_differences(eval_set, settings))}"
      )
    eval_set = settings
  if source in _BY_LENGTH:
    eval_set = {**eval_set, f"{source} length": length}
  return points, eval_set, length


def _bucket_row(record: dict[str, Any], bucket: tuple[str, str], seed_dir: str, step: int) -> dict[str, Any]:
  measure, label = bucket
  buckets = record.get("by", {})
  if measure not in buckets:
    raise CompareError(
      f"--bucket={measure}:{label}: the tasks results of step {step} in {seed_dir}/eval have no measure "
      f"{measure!r}; they have {sorted(buckets)}"
    )
  rows = {row["bucket"]: row for row in buckets[measure]}
  if label not in rows:
    raise CompareError(
      f"--bucket={measure}:{label}: the tasks results of step {step} in {seed_dir}/eval have {measure} buckets "
      f"{list(rows)} only"
    )
  return rows[label]


def load_arm(
  name: str, source: str, metric: str, length: int | None = None, bucket: tuple[str, str] | None = None
) -> tuple[Arm, int | None]:
  """The seeds and evaluations of the arm in workdir `name`; (arm, the context length read,
  for --results). `bucket`: with source "tasks", (measure, label) of the bucket to read."""
  workdir = os.path.abspath(name)
  problem = _arm_error(name)
  if problem:
    raise CompareError(problem)
  count = seeds_record(workdir).get("seeds", 0)
  if not isinstance(count, int) or count < 1:
    raise CompareError(f"{name}/seeds.json records {count!r} seeds: not a run of several seeds")
  key = METRICS[source][metric]
  arm = Arm(name, workdir, {}, {}, {}, count, seeds_record(workdir).get("seeds_mode"))
  for index in range(count):
    seed_dir = seed_workdir(workdir, index)
    config = saved_config(seed_dir)
    if config is None:
      continue  # not started yet (a sequential run), or killed before its first checkpoint
    tokens_per_step = config["data"]["batch_size"] * config["data"]["seq_len"]
    if source == "metrics":
      points, results_set = _points_from_metrics(seed_dir, key, tokens_per_step), {}
    else:
      points, results_set, length = _points_from_results(seed_dir, source, key, length, tokens_per_step, bucket)
    if not points:
      continue
    arm.seeds[index], arm.configs[index] = points, config
    eval_set = {**_eval_set(config, seed_dir), **results_set}
    if arm.eval_set and _differences(arm.eval_set, eval_set):
      raise CompareError(
        f"{seed_dir} is evaluated on other data than seed {min(arm.seeds)} of its arm: "
        f"{'; '.join(_differences(arm.eval_set, eval_set))}"
      )
    arm.eval_set = arm.eval_set or eval_set
  if not arm.seeds:
    where = (
      "eval records in metrics.jsonl (train.eval_batches=0?)"
      if source == "metrics"
      else f"{source} results in eval/ (run python -m castle_jax.eval.{source} on each seed's workdir)"
      if source in _BY_LENGTH
      else "tasks results in eval/ (run python -m castle_jax.eval.tasks --workdir=<arm>/seed_<k> on each seed)"
    )
    raise CompareError(f"{name}: none of its {count} seeds has {where}")
  return arm, length


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
  return [f"{key} {a.get(key)!r} vs {b.get(key)!r}" for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


def check_comparable(arms: list[Arm], unpaired: bool) -> bool:
  """Raises CompareError naming arms evaluated on different data, and, unless `unpaired`,
  arms without common seed indices or with another data order for the same index. Returns
  whether the differences are paired."""
  base = arms[0]
  for arm in arms[1:]:
    differing = _differences(base.eval_set, arm.eval_set)
    if differing:
      raise CompareError(
        f"{arm.name} and {base.name} are evaluated on different data ({'; '.join(differing)}): compare arms "
        "trained and evaluated with the same data settings"
      )
  if unpaired:
    return False
  for arm in arms[1:]:
    common = sorted(set(base.seeds) & set(arm.seeds))
    if not common:
      raise CompareError(
        f"{arm.name} (seeds {sorted(arm.seeds)}) and {base.name} (seeds {sorted(base.seeds)}) have no seed "
        "index in common: no paired comparison; pass --unpaired for unpaired intervals (Welch's t test)"
      )
    for index in common:
      order = [
        f"data.{key} {base.configs[index]['data'].get(key)!r} vs {arm.configs[index]['data'].get(key)!r}"
        for key in _DATA_ORDER_KEYS
        if base.configs[index]["data"].get(key) != arm.configs[index]["data"].get(key)
      ]
      if order:
        raise CompareError(
          f"seed {index} of {arm.name} and of {base.name} read the data in another order "
          f"({'; '.join(order)}): not paired; pass --unpaired for unpaired intervals (Welch's t test)"
        )
  return True


# --- the comparisons --------------------------------------------------------------------------------


def _compare_values(arms: list[Arm], values: list[dict[int, float]], paired: bool) -> dict[str, Any]:
  """Per arm: its seeds' values and their mean interval; per later arm: the difference to
  the first."""
  rows = []
  for index, (arm, by_seed) in enumerate(zip(arms, values)):
    row = {"arm": arm.name, "workdir": arm.workdir, "values": {str(k): v for k, v in sorted(by_seed.items())}}
    row.update(mean_interval(list(by_seed.values())))
    if index:
      row["difference"] = (
        paired_difference(values[0], by_seed)
        if paired
        else unpaired_difference(list(values[0].values()), list(by_seed.values()))
      )
    rows.append(row)
  return {"arms": rows}


def at_tokens(arms: list[Arm], paired: bool, tokens: int | None = None) -> dict[str, Any]:
  """The comparison at `tokens` training tokens (default: the last evaluation every seed has)."""
  common = set.intersection(*({p.tokens for p in points} for arm in arms for points in arm.seeds.values()))
  if tokens is None:
    if not common:
      listed = "; ".join(
        f"{arm.name}: {sorted(set.intersection(*({p.tokens for p in s} for s in arm.seeds.values())))}" for arm in arms
      )
      raise CompareError(
        f"the arms have no evaluation at a common number of tokens ({listed}): evaluate them at the same steps "
        "(train.eval_every) with the same tokens per step"
      )
    tokens = max(common)
  elif tokens not in common:
    raise CompareError(f"--at_tokens={tokens}: not a token count every seed has evaluated; common: {sorted(common)}")
  values = [{k: next(p.value for p in s if p.tokens == tokens) for k, s in arm.seeds.items()} for arm in arms]
  steps = {arm.name: next(p.step for p in next(iter(arm.seeds.values())) if p.tokens == tokens) for arm in arms}
  return {"tokens": tokens, "steps": steps, **_compare_values(arms, values, paired)}


def at_seconds(arms: list[Arm], paired: bool, seconds: float | None = None) -> tuple[dict[str, Any] | None, str | None]:
  """(the comparison at `seconds` of training time, interpolated, or None; why not)."""
  curves = [(arm, k, points) for arm in arms for k, points in arm.seeds.items()]
  untimed = [seed_workdir(arm.name, k) for arm, k, points in curves if all(p.seconds is None for p in points)]
  if untimed:
    return None, f"equal time: no training time (elapsed_s) in the evaluations of {', '.join(untimed)}"
  first = max(min(p.seconds for p in points if p.seconds is not None) for _, _, points in curves)
  last = min(max(p.seconds for p in points if p.seconds is not None) for _, _, points in curves)
  if seconds is None:
    if first > last:
      return None, (
        f"equal time: no training time lies within every seed's evaluations (the latest first evaluation is at "
        f"{first:.1f} s, the earliest last one at {last:.1f} s)"
      )
    seconds = last
  elif not first <= seconds <= last:
    raise CompareError(
      f"--at_seconds={seconds:g}: every seed has evaluations around times in [{first:.1f}, {last:.1f}] only"
    )
  values = [{k: value_at(points, seconds) for k, points in arm.seeds.items()} for arm in arms]
  return {"seconds": seconds, **_compare_values(arms, values, paired)}, None


def timing_notes(arms: list[Arm]) -> list[str]:
  """Why the arms' training times may not compare: seeds run another way, or another count."""
  ways = {arm.name: (arm.count, arm.seeds_mode) for arm in arms}
  if len(set(ways.values())) <= 1:
    return []
  described = ", ".join(f"{w}: {n} seed(s) {'vmapped in one step' if m == 'vmap' else m}" for w, (n, m) in ways.items())
  return [f"equal time: the arms' seeds were trained differently ({described}), so their times do not compare"]


# --- output -----------------------------------------------------------------------------------------


def _number(value: float | None, digits: int = 4) -> str:
  if value is None:
    return "-"
  if isinstance(value, float) and math.isinf(value):
    return "inf" if value > 0 else "-inf"
  return f"{value:.{digits}f}"


def _p(value: float | None) -> str:
  return "-" if value is None else f"{value:.3g}"


def describe_difference(difference: dict[str, Any]) -> str:
  """ "+0.082 [-0.443, +0.606], p = 0.654" of a `paired_difference` (no interval or p where
  there are too few seeds for them)."""
  text = f"{difference['mean']:+.3f}"
  if difference["low"] is not None:
    text += f" [{difference['low']:+.3f}, {difference['high']:+.3f}]"
  if difference["p"] is not None:
    text += f", p = {difference['p']:.3g}"
  return text


def format_comparison(title: str, comparison: dict[str, Any]) -> str:
  headers = ["arm", "seeds", "mean", "95% interval", "diff vs first", "95% interval", "t", "p", "Wilcoxon p"]
  rows = []
  for row in comparison["arms"]:
    interval = f"[{_number(row['low'])}, {_number(row['high'])}]" if row["low"] is not None else "-"
    cells = [row["arm"], row["n"], _number(row["mean"]), interval]
    difference = row.get("difference")
    if difference is None:
      cells += ["", "", "", "", ""]
    else:
      low, high = difference["low"], difference["high"]
      cells += [
        _number(difference["mean"]),
        f"[{_number(low)}, {_number(high)}]" if low is not None else "-",
        _number(difference["t"], 2),
        _p(difference["p"]),
        _p(difference["wilcoxon_p"]),
      ]
    rows.append(cells)
  return f"{title}\n{cli.format_table(headers, rows)}"


def _curve(arm: Arm, xs: Sequence[float], value) -> tuple[list[float], list[float], list[float], list[float]]:
  """(x, mean, low, high) of an arm's metric where every seed has a value."""
  kept, means, lows, highs = [], [], [], []
  for x in xs:
    values = [value(points, x) for points in arm.seeds.values()]
    if any(v is None for v in values):
      continue
    summary = mean_interval(values)
    kept.append(x)
    means.append(summary["mean"])
    lows.append(summary["low"] if summary["low"] is not None else summary["mean"])
    highs.append(summary["high"] if summary["high"] is not None else summary["mean"])
  return kept, means, lows, highs


def _at_tokens_value(points: Sequence[Point], tokens: int) -> float | None:
  return next((p.value for p in points if p.tokens == tokens), None)


def plot(path: str, arms: list[Arm], metric: str, equal_time: dict[str, Any] | None) -> str | None:
  """The metric against tokens (and training time), mean and 95% band per arm, into `path`."""
  plt = cli.pyplot()
  if plt is None:
    return None
  panels = 2 if equal_time is not None else 1
  figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
  token_counts = sorted({p.tokens for arm in arms for points in arm.seeds.values() for p in points})
  for arm in arms:
    label = f"{arm.name} ({len(arm.seeds)} seeds)"
    x, mean, low, high = _curve(arm, token_counts, _at_tokens_value)
    axes[0][0].plot(x, mean, marker="o", label=label)
    axes[0][0].fill_between(x, low, high, alpha=0.2)
    if equal_time is not None:
      timed = [p.seconds for points in arm.seeds.values() for p in points if p.seconds is not None]
      grid = np.linspace(min(timed), max(timed), 60)
      x, mean, low, high = _curve(arm, grid, value_at)
      axes[0][1].plot(x, mean, label=label)
      axes[0][1].fill_between(x, low, high, alpha=0.2)
  axes[0][0].set_xlabel("training tokens")
  if equal_time is not None:
    axes[0][1].set_xlabel("training time after the first step (s)")
  for axis in axes[0]:
    axis.set_ylabel(metric)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
  figure.suptitle(f"{metric}: mean and {LEVEL:.0%} interval over seeds", fontsize=10)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)
  return path


def _main(argv: Sequence[str]) -> None:
  parser = command_line.ArgumentParser(prog="python -m castle_jax.eval.compare", description=__doc__)
  parser.add_argument("arms", nargs="+", help="workdirs of runs of several seeds (train.seeds); the first is the base")
  parser.add_argument("--results", choices=SOURCES, default="metrics", help="what to read (default: metrics.jsonl)")
  parser.add_argument(
    "--metric",
    default=None,
    help="eval_loss (default), perplexity, bits_per_byte; passkey: all_tokens (default), first_token; "
    "tasks: query_accuracy (default), token_accuracy, answer_loss",
  )
  parser.add_argument(
    "--length", type=command_line.positive_int, default=None, help="--results=perplexity|passkey: the context length"
  )
  parser.add_argument(
    "--at_tokens", type=command_line.positive_int, default=None, help="tokens (default: the last common)"
  )
  parser.add_argument("--at_seconds", type=float, default=None, help="training seconds (default: the last common)")
  parser.add_argument(
    "--bucket",
    default=None,
    metavar="MEASURE:LABEL",
    help="--results=tasks: one bucket of a measure instead of all queries, e.g. order:0 (MQAR's first queries)",
  )
  parser.add_argument("--unpaired", action="store_true", help="compare arms that are not paired (Welch's t test)")
  parser.add_argument("--output", default=None, help="a directory (default: <first arm>/compare/)")
  args = parser.parse_args(argv)
  metric = args.metric or DEFAULT_METRIC[args.results]
  if metric not in METRICS[args.results]:
    raise CompareError(
      f"--metric={metric}: with --results={args.results} choose one of {sorted(METRICS[args.results])}"
    )
  if args.length is not None and args.results not in _BY_LENGTH:
    raise CompareError(f"--length applies to --results=perplexity or passkey, not to --results={args.results}")
  bucket = None
  if args.bucket is not None:
    if args.results != "tasks":
      raise CompareError(f"--bucket applies to --results=tasks, not to --results={args.results}")
    measure, colon, label = args.bucket.partition(":")
    if not (measure and colon and label):
      raise CompareError(f"--bucket={args.bucket}: pass MEASURE:LABEL, e.g. --bucket=order:0")
    bucket = (measure, label)
  workdirs = [os.path.abspath(w) for w in args.arms]
  repeated = sorted({w for w in workdirs if workdirs.count(w) > 1})
  if repeated:
    raise CompareError(f"{repeated[0]} is given twice: name each arm once")
  arms, length = [], args.length
  for name in args.arms:
    arm, length = load_arm(name, args.results, metric, length, bucket)
    arms.append(arm)
  paired = check_comparable(arms, args.unpaired)
  equal_tokens = at_tokens(arms, paired, args.at_tokens)
  equal_time, why_not = at_seconds(arms, paired, args.at_seconds)
  notes = ([why_not] if why_not else []) + timing_notes(arms)
  record = {
    "compare": metric,
    "results": args.results,
    "length": length,
    "bucket": args.bucket,
    "paired": paired,
    "level": LEVEL,
    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "eval_set": arms[0].eval_set,
    "arms": [{"arm": a.name, "workdir": a.workdir, "seeds": sorted(a.seeds), "seeds_mode": a.seeds_mode} for a in arms],
    "equal_tokens": equal_tokens,
    "equal_time": equal_time,
    "notes": notes,
  }
  stem = outputs.publish(
    lambda path: cli.write_json(path, record),
    os.path.join(os.path.abspath(args.output or os.path.join(workdirs[0], "compare")), f"compare_{metric}"),
    ".json",
    beside=(".png",),
  )
  plotted = plot(stem + ".png", arms, metric, equal_time)
  print(f"wrote {stem}.json" + (f" and {plotted}" if plotted else ""))
  what = (
    f"{metric}" + (f" at length {length:,}" if length else "") + (f" in bucket {args.bucket}" if args.bucket else "")
  )
  kind = "paired by seed index" if paired else "unpaired (Welch's t test)"
  steps = ", ".join(f"{name} step {step}" for name, step in equal_tokens["steps"].items())
  tables = [format_comparison(f"{what} at {equal_tokens['tokens']:,} training tokens ({steps}); {kind}", equal_tokens)]
  if equal_time is not None:
    tables.append(
      format_comparison(
        f"{what} at {equal_time['seconds']:.1f} s of training after the first step (interpolated); {kind}", equal_time
      )
    )
  for note in notes:
    print(f"note: {note}")
  print("\n\n".join(tables))


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m castle_jax.eval.compare ...` (argv without the program name); 0, or 1 after one ERROR line."""
  return cli.run_main(_main, argv)


if __name__ == "__main__":
  sys.exit(main())
