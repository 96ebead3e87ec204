"""Perplexity and bits per byte against context length.

`loss_sums` and `summarize` are what training's evaluation computes too (train/step.py,
train/trainer.py): the summed next-token loss in nats, the scored tokens and the UTF-8
bytes they stand for, then loss = nll / tokens, perplexity = exp(loss) and bits per
byte = nll / ln 2 / bytes (tokenizer-independent, so byte-level and BPE runs compare).

Command line, on a trained workdir:

    python -m castle_jax.eval.perplexity --workdir=runs/drt_tiny --lengths=2048,8192,16384,65536 \\
        [--windows=4 --step=N --output=DIR_OR_FILE.json]

Windows: the validation split the workdir's config names is read as one token stream
(`[BOS] doc [EOS]` in file order, as training packs it); window w of length L is
tokens [w L, (w + 1) L] as inputs and the same shifted by one as targets, so every
length reads the same text from the same start. A length whose windows need more tokens
than the split has is skipped with a message naming it and the available tokens (an
error when no length fits). Losses come from the model family's `token_losses` hook.
Prints a table and writes JSON and a PNG of perplexity against length (log x; needs
matplotlib) to `--output` (default `<workdir>/eval/perplexity_step<N>.json/.png`; a later evaluation of the same step
writes `perplexity_step<N>-2.json`, and so on: no result is replaced).
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.eval import cli
from castle_jax.models import family_of


def loss_sums(
  model: nn.Module, params: Any, batch: dict[str, jax.Array], *, pad_id: int, token_byte_lengths: jax.Array
) -> dict[str, jax.Array]:
  """Sums over a batch: "nll_sum" (nats), "tokens" (scored targets) and "bytes" (the UTF-8
  bytes of the scored targets), from the family's `token_losses` (no noise).

  Args:
    batch: {"inputs": int [B, T], "targets": int [B, T]}.
    token_byte_lengths: float32 [vocab_size], the tokenizer's bytes per id.
  """
  nll, weights = family_of(model).token_losses(model, params, batch, pad_id, None)
  byte_counts = jnp.take(token_byte_lengths, batch["targets"]) * weights
  return {"nll_sum": jnp.sum(nll), "tokens": jnp.sum(weights), "bytes": jnp.sum(byte_counts)}


def summarize(totals: dict[str, float]) -> dict[str, float]:
  """loss (nats/token), perplexity and bits_per_byte from summed `loss_sums`."""
  loss = totals["nll_sum"] / max(totals["tokens"], 1.0)
  return {
    "loss": loss,
    "perplexity": math.exp(min(loss, 80.0)),
    "bits_per_byte": totals["nll_sum"] / math.log(2) / max(totals["bytes"], 1.0),
  }


def windows_of(stream: np.ndarray, length: int, count: int) -> list[dict[str, np.ndarray]]:
  """`count` consecutive windows {"inputs", "targets": int32 [1, length]} from the start of
  `stream` (window w: inputs stream[w L:(w+1) L], targets one token later)."""
  if stream.size < count * length + 1:
    raise ValueError(
      f"{count} windows of {length} tokens need {count * length + 1} tokens, the stream has {stream.size}"
    )
  return [
    {
      "inputs": stream[None, w * length : (w + 1) * length],
      "targets": stream[None, w * length + 1 : (w + 1) * length + 1],
    }
    for w in range(count)
  ]


def _main(argv: Sequence[str]) -> None:
  parser = cli.make_parser("python -m castle_jax.eval.perplexity", __doc__, lengths="2048,8192,16384,65536")
  parser.add_argument("--windows", type=int, default=4, help="windows per length")
  args = parser.parse_args(argv)
  lengths = cli.parse_lengths(args.lengths)
  cli.require(args.windows >= 1, "--windows", "an integer >= 1", args.windows)
  cli.check_output(args)
  (model, params, tokenizer, step), config = cli.load(args)
  stream = cli.validation_tokens(config, tokenizer, args.windows * max(lengths) + 1, args.data_dir)
  sums = jax.jit(
    lambda p, batch: loss_sums(
      model,
      p,
      batch,
      pad_id=tokenizer.pad_id,
      token_byte_lengths=jnp.asarray(tokenizer.token_byte_lengths, jnp.float32),
    )
  )
  results, skipped = [], []
  with cli.on_mesh(params):
    for length in lengths:
      if stream.size < args.windows * length + 1:
        message = (
          f"length {length:,} skipped: {args.windows} windows need {args.windows * length + 1:,} tokens, "
          f"the validation split ({config.data.dataset}, {config.data.eval_split}) has {stream.size:,}"
        )
        print(message, file=sys.stderr, flush=True)
        skipped.append({"length": length, "reason": message})
        continue
      start = time.perf_counter()
      totals = {"nll_sum": 0.0, "tokens": 0.0, "bytes": 0.0}
      with cli.progress(args.windows, f"perplexity {length:,}", "window") as bar:
        for window in windows_of(stream, length, args.windows):
          window_sums = jax.device_get(sums(params, window))
          totals = {k: totals[k] + float(window_sums[k]) for k in totals}
          bar.update(1)
      results.append(
        {
          "length": length,
          "windows": args.windows,
          **totals,
          **summarize(totals),
          "seconds": time.perf_counter() - start,
        }
      )
  if not results:
    cli.fail(
      f"--lengths={args.lengths}: no length fits the validation split ({stream.size:,} tokens) with "
      f"--windows={args.windows}; lower them"
    )
  cli.finish(
    "perplexity",
    args,
    config,
    step,
    headers=["length", "windows", "tokens", "loss", "perplexity", "bits/byte", "seconds"],
    rows=[
      [
        r["length"],
        r["windows"],
        int(r["tokens"]),
        r["loss"],
        r["perplexity"],
        r["bits_per_byte"],
        f"{r['seconds']:.1f}",
      ]
      for r in results
    ],
    record={"windows": args.windows, "results": results, "skipped": skipped},
    lengths=[r["length"] for r in results],
    series={"perplexity": [r["perplexity"] for r in results]},
    ylabel="perplexity",
    title="Validation perplexity",
  )


def main(argv: Sequence[str] | None = None) -> int:
  """`python -m castle_jax.eval.perplexity ...` (argv without the program name); 0, or 1 after one ERROR line."""
  return cli.run_main(_main, argv)


if __name__ == "__main__":
  sys.exit(main())
