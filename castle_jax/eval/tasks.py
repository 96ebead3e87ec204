"""Scores a trained model on fresh examples of a mechanism task (variable tracking with
overwrites, multi-query associative recall; docs/tasks.md).

Every answer is scored under teacher forcing: token accuracy (greedy prediction of each
answer token), query accuracy (every token of the answer right) and the answer loss
(mean negative log-likelihood per answer token, nats), overall and per bucket of each
query's measures: for variable tracking the overwrite count of the queried name, for MQAR
the query's order (0: the first, the one that elimination among the values already answered
cannot give), and for both tasks the distance in assignments (pairs) and in tokens (log2
buckets).

The examples are those of the split "heldout" under `--seed`, which neither training
(data.train_split) nor its evaluation (data.eval_split) reads. The knobs are the task's
defaults, overridden by the workdir's data.<task> section, overridden by
`--config.data.<task>.<knob>=value` (the training flags' names).

Command line:

    python -m castle_jax.eval.tasks --workdir=runs/vt --task=variable_tracking --examples=500 \\
        [--seed=0 --batch_size=32 --step=N --output=DIR_OR_NEW_FILE.json] \\
        [--config.data.variable_tracking.overwrite_rate=0.9 ...]

`--task` defaults to the workdir's data.task when that is a mechanism task. Prints the
table and writes JSON (knobs, overall and per-bucket results, one record per query) to a
new file, never over an earlier one: `--output` as a new .json path, or a directory that
gets `tasks_<task>_step<N>_<UTC time>.json` (default `<workdir>/eval/`; with
`--pretrained`, `--output` is required).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import time
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from castle_jax.data.task_data import TASKS, default_knobs, parse_knobs, task_examples
from castle_jax.data.task_prompts import TaskExample
from castle_jax.data.tokenizer import Tokenizer
from castle_jax import outputs
from castle_jax.eval import cli
from castle_jax.models import family_of

HELDOUT_SPLIT = "heldout"
_OVERRIDE = re.compile(r"--config\.data\.(\w+)\.(\w+)=(.*)")


def score_examples(
  model, params, examples: Sequence[TaskExample], *, pad_id: int, batch_size: int = 32
) -> list[dict[str, Any]]:
  """One record per query of each example, in order: {"example", "query", its measures,
  "answer_tokens", "correct_tokens", "nll"} (nll summed over the answer's tokens).

  The prompts are right-padded to one length and batched `batch_size` at a time (the last
  batch filled with copies), so the model runs one shape; logits come from the model
  family's `last_logits` hook, from the first answer's position on.
  """
  length = max(len(e.tokens) for e in examples)
  first = min(int(e.answer_starts.min()) for e in examples)
  count = length - first + 1  # rows for positions first - 1 .. length - 1
  hook = family_of(model).last_logits
  records = []
  for begin in range(0, len(examples), batch_size):
    chunk = list(examples[begin : begin + batch_size])
    tokens = np.full((batch_size, length), pad_id, np.int32)
    for row in range(batch_size):
      prompt = chunk[min(row, len(chunk) - 1)].tokens
      tokens[row, : len(prompt)] = prompt
    logits = np.asarray(hook(model, params, jnp.asarray(tokens), count), np.float32)
    log_probs = logits - _logsumexp(logits)
    for row, example in enumerate(chunk):
      for q, (start, size) in enumerate(zip(example.answer_starts, example.answer_lengths)):
        positions = np.arange(start, start + size)
        rows = log_probs[row, positions - 1 - (length - count)]
        targets = example.tokens[positions]
        records.append(
          {
            "example": begin + row,
            "query": q,
            **{name: int(values[q]) for name, values in example.measures.items()},
            "answer_tokens": int(size),
            "correct_tokens": int((rows.argmax(-1) == targets).sum()),
            "nll": float(-rows[np.arange(size), targets].sum()),
          }
        )
  return records


def _logsumexp(x: np.ndarray) -> np.ndarray:
  top = x.max(-1, keepdims=True)
  return top + np.log(np.exp(x - top).sum(-1, keepdims=True))


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Query and token accuracy and answer loss (nats per answer token) of `records`."""
  tokens = sum(r["answer_tokens"] for r in records)
  return {
    "queries": len(records),
    "answer_tokens": tokens,
    "query_accuracy": float(np.mean([r["correct_tokens"] == r["answer_tokens"] for r in records])),
    "token_accuracy": sum(r["correct_tokens"] for r in records) / tokens,
    "answer_loss": sum(r["nll"] for r in records) / tokens,
  }


def bucket_of(measure: str, value: int) -> tuple[int, str]:
  """(sort key, label): overwrite counts and query orders as they are; distances in log2
  buckets 0, 1, 2-3, 4-7, ..."""
  if measure in ("overwrites", "order") or value < 2:
    return value, str(value)
  low = 1 << (value.bit_length() - 1)
  return low, f"{low}-{2 * low - 1}"


def by_bucket(records: Sequence[Mapping[str, Any]], measure: str) -> list[dict[str, Any]]:
  """`summarize` per bucket of `measure`, in increasing order."""
  groups: dict[tuple[int, str], list] = {}
  for record in records:
    groups.setdefault(bucket_of(measure, record[measure]), []).append(record)
  return [{"bucket": label, **summarize(groups[key, label])} for key, label in sorted(groups)]


def evaluate_task(
  model,
  params,
  tokenizer: Tokenizer,
  task: str,
  knobs: Mapping[str, Any] | None = None,
  *,
  examples: int = 500,
  seed: int = 0,
  batch_size: int = 32,
) -> dict[str, Any]:
  """Scores `model` on `examples` fresh prompts of `task` (the split "heldout" under `seed`).

  Args:
    model, params: a trained model (e.g. from `castle_jax.workdir.load_trained_model`).
    tokenizer: the one it was trained with.
    task: "variable_tracking" or "mqar".
    knobs: data.<task> values that differ from the defaults (ValueError if out of range).
    examples, seed, batch_size: how many prompts, which ones, and how many per forward pass.

  Returns:
    {"task", "knobs", "examples", "seed", "chance_query_accuracy" (a uniform guess of
    the value), "overall": summarize(...), "by": {measure: by_bucket(...)},
    "per_query": score_examples(...)}.
  """
  if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
    raise ValueError(f"examples must be an int >= 1, got {examples!r}")
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
  parsed = parse_knobs(task, {**default_knobs(task), **(knobs or {})})
  prompts = task_examples(task, tokenizer, parsed, examples, seed=seed, split=HELDOUT_SPLIT)
  records = score_examples(model, params, prompts, pad_id=tokenizer.pad_id, batch_size=batch_size)
  return {
    "task": task,
    "knobs": dataclasses.asdict(parsed),
    "examples": examples,
    "seed": seed,
    "chance_query_accuracy": 1 / parsed.value_vocab,
    "overall": summarize(records),
    "by": {measure: by_bucket(records, measure) for measure in prompts[0].measures},
    "per_query": records,
  }


def _table(result: dict[str, Any]) -> str:
  headers = ["measure", "bucket", "queries", "query acc", "token acc", "answer loss"]
  rows = [["all", "", *_numbers(result["overall"])]]
  for measure, buckets in result["by"].items():
    rows += [[measure, b["bucket"], *_numbers(b)] for b in buckets]
  return cli.format_table(headers, rows)


def _numbers(summary: Mapping[str, Any]) -> list[Any]:
  return [summary["queries"], summary["query_accuracy"], summary["token_accuracy"], summary["answer_loss"]]


def _knob_overrides(extra: Sequence[str], task: str) -> dict[str, Any]:
  """{knob: value} from `--config.data.<task>.<knob>=value` flags, typed like the defaults."""
  defaults, overrides = default_knobs(task), {}
  for flag in extra:
    match = _OVERRIDE.fullmatch(flag)
    if match is None:
      cli.fail(f"unrecognized argument {flag!r}; task knobs are --config.data.{task}.<knob>=<value> (see --help)")
    section, knob, text = match.groups()
    if section != task:
      cli.fail(f"{flag.split('=')[0]} does not apply to --task={task}; its knobs are --config.data.{task}.<knob>")
    if knob not in defaults:
      cli.fail(f"{flag.split('=')[0]} is not a knob of {task}; the knobs are {sorted(defaults)}")
    kind = type(defaults[knob])
    try:
      overrides[knob] = kind(text)
    except ValueError:
      cli.fail(f"{flag.split('=')[0]} must be {'an int' if kind is int else 'a number'}, got {text!r}")
  return overrides


def _main(argv: Sequence[str]) -> None:
  parser = cli.make_parser("python -m castle_jax.eval.tasks", __doc__, lengths=None)
  parser.add_argument("--task", choices=tuple(TASKS), default=None, help="default: the workdir's data.task")
  parser.add_argument("--examples", type=int, default=500, help="prompts to score")
  parser.add_argument("--seed", type=int, default=0, help="which prompts (of the split 'heldout')")
  parser.add_argument("--batch_size", type=int, default=32, help="prompts per forward pass")
  args, extra = parser.parse_known_args(argv)
  cli.require(args.examples >= 1, "--examples", "an integer >= 1", args.examples)
  cli.require(args.batch_size >= 1, "--batch_size", "an integer >= 1", args.batch_size)
  cli.check_output(args)
  (model, params, tokenizer, step), config = cli.load(args)
  task = args.task or config.data.get("task")
  if task not in TASKS:
    cli.fail(f"--task is needed: the model trained data.task={task!r}; pass --task={' or --task='.join(TASKS)}")
  trained = config.data.get(task)  # None in a workdir older than the task
  knobs = {**(dict(trained.items()) if trained is not None else {}), **_knob_overrides(extra, task)}
  try:
    parse_knobs(task, {**default_knobs(task), **knobs})
  except ValueError as e:
    cli.fail(str(e))
  start = time.perf_counter()
  with cli.on_mesh(params):
    try:
      result = evaluate_task(
        model, params, tokenizer, task, knobs, examples=args.examples, seed=args.seed, batch_size=args.batch_size
      )
    except ValueError as e:  # a tokenizer that cannot build the prompts (e.g. a Hugging Face model's)
      cli.fail(str(e))
  seconds = time.perf_counter() - start
  overall = result["overall"]
  print(
    f"{task} at step {step}: {args.examples} examples, {overall['queries']} queries; query accuracy "
    f"{overall['query_accuracy']:.4f} (a uniform guess: {result['chance_query_accuracy']:.4f}), "
    f"{seconds:.1f} s"
  )
  print(_table(result))
  header = {**cli.header("tasks", args, config, step), "dataset": None, "split": HELDOUT_SPLIT}
  record = {**header, "seconds": seconds, **result}
  stem = outputs.publish(
    lambda path: cli.write_json(path, record),
    cli.output_stem(args.output, cli.default_output_dir(args), f"tasks_{task}", step),
    ".json",
  )
  print(f"wrote {stem}.json")


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m castle_jax.eval.tasks ...` (argv without the program name); 0, or 1 after one ERROR line."""
  return cli.run_main(_main, argv)


if __name__ == "__main__":
  sys.exit(main())
