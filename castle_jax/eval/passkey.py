"""Passkey retrieval (single needle in a haystack), the GCA paper's template (App. D):

    <haystack text> The passkey is: <passkey>. <haystack text> ...
    What is the passkey? The passkey is <passkey>

The haystack is real corpus text (any token stream), the passkey `digits` random
decimal digits, the needle at a random depth; everything is deterministic by seed.
A model passes an example when its greedy prediction of the passkey's first token
(first-token accuracy) or of every passkey token under teacher forcing (all-token
accuracy) is right.

For chunked models the question can be aligned so that a chunk boundary falls right
before " is <passkey>" (`align_to=S`), as the paper pads its inputs: the retrieval made
at the end of "...What is the passkey? The passkey" then serves the answer's chunk.

Command line, on a trained workdir:

    python -m castle_jax.eval.passkey --workdir=runs/drt_tiny_passkey --lengths=1024,4096,16384,65536 \
        [--examples=20 --seed=0 --digits=5 --depths=even --step=N --output=DIR_OR_FILE.json]
        [--top_k=K]  (DRT: retrieve K chunks instead of the trained model's top_k)

The haystack is the start of the validation split the workdir's config names (as one
`[BOS] doc [EOS]` stream, repeated when shorter than a prompt). Example i of every length
has the same passkey (seed `seed * 1_000_000 + i`) and, with `--depths=even` (default),
its needle at depth (i + 0.5) / examples of the filler, so the depths cover the context
evenly; `--depths=random` draws them from the seed. DRT models get `align_to` = their
chunk size (model.family_kwargs.chunk_size). Logits come from the model family's
`last_logits` hook (only the last `length - answer_start + 1` positions), so a family
that streams its memory (DRT) scores lengths its device could not hold at once. Prints a
table (length, first-token and all-token accuracy, examples, seconds) and writes JSON
and a PNG plot of accuracy against length (log x; needs matplotlib) to `--output`
(default `<workdir>/eval/passkey_step<N>.json/.png`; a later evaluation of the same step
writes `passkey_step<N>-2.json`, and so on: no result is replaced).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.data.passkey_prompts import PasskeyExample, make_example
from castle_jax.data.tokenizer import Tokenizer
from castle_jax.eval import cli
from castle_jax.models import family_of
from castle_jax.models.drt import DRTOptions


def tail_count(example: PasskeyExample) -> int:
  """How many last positions' logits `score_tail` needs: from the one that predicts the
  passkey's first token to the end of the prompt (length - answer_start + 1)."""
  return example.tokens.shape[0] - example.answer_start + 1


def score_tail(tail_logits: np.ndarray, example: PasskeyExample) -> tuple[bool, bool]:
  """(first-token correct, all tokens correct) from the teacher-forced logits
  [tail_count(example), vocab] of the prompt's last positions (row j predicts token
  answer_start + j)."""
  count = example.answer_length
  if tail_logits.shape[0] != tail_count(example):
    raise ValueError(
      f"tail_logits has {tail_logits.shape[0]} rows; the example needs the last "
      f"{tail_count(example)} positions (tail_count)"
    )
  predicted = np.argmax(np.asarray(tail_logits[:count]), axis=-1)
  expected = example.tokens[example.answer_start : example.answer_start + count]
  return bool(predicted[0] == expected[0]), bool(np.all(predicted == expected))


def score(logits: np.ndarray, example: PasskeyExample) -> tuple[bool, bool]:
  """(first-token correct, all tokens correct) from teacher-forced logits [length, vocab]
  of the example's tokens (logits[i] predicts token i + 1)."""
  return score_tail(np.asarray(logits)[logits.shape[0] - tail_count(example) :], example)


def accuracy(logits_fn: Callable[[np.ndarray], np.ndarray], examples: list[PasskeyExample]) -> dict[str, float]:
  """First-token and all-token accuracy of `logits_fn` (int [1, length] -> [1, length, vocab])."""
  results = [score(np.asarray(logits_fn(e.tokens[None]))[0], e) for e in examples]
  return _summary(results)


def _summary(results: list[tuple[bool, bool]]) -> dict[str, float]:
  return {
    "first_token": float(np.mean([r[0] for r in results])),
    "all_tokens": float(np.mean([r[1] for r in results])),
    "examples": len(results),
  }


def make_examples(
  tokenizer: Tokenizer,
  haystack: np.ndarray,
  length: int,
  count: int,
  *,
  seed: int = 0,
  digits: int = 5,
  depths: str = "even",
  align_to: int | None = None,
) -> list[PasskeyExample]:
  """`count` prompts of `length` tokens; example i uses seed `seed * 1_000_000 + i` (the same
  passkey at every length) and depth (i + 0.5) / count (`depths="even"`) or a random one
  (`depths="random"`)."""
  if depths not in ("even", "random"):
    raise ValueError(f"depths must be 'even' or 'random', got {depths!r}")
  return [
    make_example(
      tokenizer,
      haystack,
      length,
      seed=seed * 1_000_000 + i,
      digits=digits,
      depth=(i + 0.5) / count if depths == "even" else None,
      align_to=align_to,
    )
    for i in range(count)
  ]


def score_batch(model, params, examples: Sequence[PasskeyExample]) -> list[tuple[bool, bool]]:
  """Scores prompts of one length in one call of the family's `last_logits` hook, which
  returns only the tail positions the answers need."""
  count = max(tail_count(e) for e in examples)
  tokens = jnp.asarray(np.stack([e.tokens for e in examples]))
  logits = np.asarray(family_of(model).last_logits(model, params, tokens, count), np.float32)
  return [score_tail(tail[count - tail_count(e) :], e) for tail, e in zip(logits, examples)]


def device_memory() -> dict[str, float]:
  """The first device's memory in GiB (peak since start, in use), where the backend reports it (GPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return {
    key: stats[name] / 2**30
    for key, name in (("device_peak_gib", "peak_bytes_in_use"), ("device_in_use_gib", "bytes_in_use"))
    if name in stats
  }


def chunk_alignment(model) -> int | None:
  """The chunk size a model's passkey prompts align to (DRT), else None."""
  return DRTOptions.from_config(model.config).chunk_size if model.config.family == "drt" else None


def with_top_k(model, top_k: int | None):
  """`model` retrieving `top_k` chunks per retrieval (DRT only); None keeps its own. A DRT
  trained retrieving every chunk of its short windows is evaluated with a small k."""
  if top_k is None:
    return model
  if model.config.family != "drt":
    cli.fail(f"--top_k applies to DRT models (model.family 'drt'), not {model.config.family!r}")
  cli.require(top_k >= 1, "--top_k", "an integer >= 1", top_k)
  return model.clone(options=dataclasses.replace(model.options, top_k=top_k))


def _main(argv: Sequence[str]) -> None:
  parser = cli.make_parser("python -m castle_jax.eval.passkey", __doc__, lengths="1024,4096,16384,65536")
  parser.add_argument("--examples", type=int, default=20, help="prompts per length")
  parser.add_argument("--seed", type=int, default=0, help="seed of the passkeys, depths and filler offsets")
  parser.add_argument("--digits", type=int, default=5, help="passkey length in decimal digits")
  parser.add_argument(
    "--depths",
    choices=("even", "random"),
    default="even",
    help="needle depths: evenly spaced over the examples, or random by seed",
  )
  parser.add_argument("--batch_size", type=int, default=1, help="prompts per forward pass")
  parser.add_argument(
    "--top_k",
    type=int,
    default=None,
    help="DRT only: chunks retrieved per retrieval (default: the trained model's top_k)",
  )
  args = parser.parse_args(argv)
  lengths = cli.parse_lengths(args.lengths)
  cli.require(args.examples >= 1, "--examples", "an integer >= 1", args.examples)
  cli.require(args.digits >= 1, "--digits", "an integer >= 1", args.digits)
  cli.require(args.batch_size >= 1, "--batch_size", "an integer >= 1", args.batch_size)
  cli.check_output(args)
  (model, params, tokenizer, step), config = cli.load(args)
  model = with_top_k(model, args.top_k)
  align_to = chunk_alignment(model)
  haystack = cli.validation_tokens(config, tokenizer, max(lengths), args.data_dir)
  results = []
  with cli.on_mesh(params):
    for length in lengths:
      try:
        examples = make_examples(
          tokenizer,
          haystack,
          length,
          args.examples,
          seed=args.seed,
          digits=args.digits,
          depths=args.depths,
          align_to=align_to,
        )
      except ValueError as e:
        cli.fail(f"--lengths: {e}")
      start = time.perf_counter()
      scored = []
      with cli.progress(len(examples), f"passkey {length:,}", "example") as bar:
        for first in range(0, len(examples), args.batch_size):
          scored += score_batch(model, params, examples[first : first + args.batch_size])
          bar.update(min(args.batch_size, len(examples) - first))
      summary = _summary(scored)
      results.append(
        {
          "length": length,
          **summary,
          "seconds": time.perf_counter() - start,
          **device_memory(),
          "per_example": [
            {
              "passkey": e.passkey,
              "needle_position": e.needle_position,
              "depth": round(e.needle_position / length, 4),
              "first_token": f,
              "all_tokens": a,
            }
            for e, (f, a) in zip(examples, scored)
          ],
        }
      )
      print(
        f"length {length:,}: first-token {summary['first_token']:.3f}, all-token {summary['all_tokens']:.3f}",
        file=sys.stderr,
        flush=True,
      )
  cli.finish(
    "passkey",
    args,
    config,
    step,
    headers=["length", "first-token acc", "all-token acc", "examples", "seconds"],
    rows=[[r["length"], r["first_token"], r["all_tokens"], r["examples"], f"{r['seconds']:.1f}"] for r in results],
    record={
      "examples": args.examples,
      "digits": args.digits,
      "seed": args.seed,
      "depths": args.depths,
      "align_to": align_to,
      "top_k": args.top_k,
      "haystack_tokens": int(haystack.size),
      "results": results,
    },
    lengths=lengths,
    series={"first token": [r["first_token"] for r in results], "all tokens": [r["all_tokens"] for r in results]},
    ylabel="passkey accuracy",
    ylim=(-0.05, 1.05),
    title="Passkey retrieval",
  )


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m castle_jax.eval.passkey ...` (argv without the program name); 0, or 1 after one ERROR line."""
  return cli.run_main(_main, argv)


if __name__ == "__main__":
  sys.exit(main())
