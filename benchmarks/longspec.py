"""LongSpec speculative decoding against the same target's autoregressive decoding.

    python -m benchmarks.longspec --target_workdir=runs/longspec_target_tiny \
        --draft=runs/longspec_draft_tiny_long --prompt_lengths=256,448 --new_tokens=64 \
        --prompts=2 --temperatures=0,1 --tree=4,16,16,16,16 --tree=1,1,1,1,1 --out=longspec.json \
        [--batch_sizes=1,4,8]

Prompts are long-file code completion: consecutive [BOS] file [EOS] pieces of the target's
validation split (files it never trained on), cut at each prompt length; a batch of B
decodes B different prompts of that length together (rows accept their own numbers of
tokens per round). For every batch size, prompt length, temperature, draft, tree and
tree-attention implementation:
  - autoregressive: the target's prefilled KV cache, then `continue_decoding` (one
    compiled `lax.scan` of single-token steps) for --new_tokens tokens;
  - speculative: `speculative_generate` (one compiled `lax.while_loop` of rounds).
Both are compiled on a warm-up prompt first and timed on decode alone (prefill excluded,
as the paper reports). At temperature 0 the speculative output must equal the
autoregressive one token for token (checked; a mismatch is reported in the table).
Several drafts (`--draft=NAME=WORKDIR`, e.g. trained without anchor-offset) make the
ablation rows; `--draft_step=N` reads every draft's checkpoint at step N (seeds that a time
limit stopped at different steps then compare at equal training). Writes every measurement to --out (JSON) and prints a table last.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


from castle_jax import command_line as cl  # noqa: E402
from castle_jax.checkpoints import CheckpointError  # noqa: E402
from castle_jax.eval.cli import format_table, validation_tokens  # noqa: E402
from castle_jax.inference import continue_decoding, prefill_caches, speculative_generate  # noqa: E402
from castle_jax.models import build_model  # noqa: E402
from castle_jax.ops.tree_attention import IMPLEMENTATIONS as TREE_ATTENTION_IMPLEMENTATIONS  # noqa: E402
from castle_jax.workdir import TrainedModel, load_draft, load_trained_model, read_config  # noqa: E402


def parse_args(argv):
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--target_workdir", required=True)
  parser.add_argument(
    "--draft", action="append", required=True, help="a draft workdir, or NAME=WORKDIR (repeat for ablation rows)"
  )
  parser.add_argument(
    "--draft_step",
    type=cl.positive_int,
    default=None,
    help="every draft's checkpoint at this step (default: each draft's newest), e.g. the last step every "
    "seed of an ablation holds, so that drafts stopped by a time limit compare at equal training",
  )
  parser.add_argument("--prompt_lengths", type=cl.positive_int_list, default=[4096, 16384])
  parser.add_argument("--new_tokens", type=cl.positive_int, default=512)
  parser.add_argument("--prompts", type=cl.positive_int, default=2, help="timed batches per length (after one warm-up)")
  parser.add_argument(
    "--batch_sizes", type=cl.positive_int_list, default=[1], help="prompts decoded together (tokens/s counts every row)"
  )
  parser.add_argument("--temperatures", type=cl.number_list, default=[0.0, 1.0])
  parser.add_argument(
    "--tree", type=cl.positive_int_list, action="append", help="nodes per level (repeat: tree vs chain)"
  )
  parser.add_argument(
    "--tree_attention",
    choices=TREE_ATTENTION_IMPLEMENTATIONS,
    action="append",
    help="xla (hybrid) and/or reference (dense), ... (repeat)",
  )
  parser.add_argument(
    "--dtype",
    default=None,
    choices=["float32", "bfloat16"],
    help="decode in this dtype instead of the configs' (float32 also sets full-precision matmuls: "
    "the check that speculative and autoregressive outputs are identical, free of bf16 "
    "rounding differences between a 1-token step and a 69-token tree pass)",
  )
  parser.add_argument("--out", type=cl.new_file, default=None, help="JSON file for every measurement (a new file)")
  args = parser.parse_args(argv)
  if min(args.temperatures) < 0:
    parser.error(f"--temperatures: {args.temperatures} must be >= 0 (0 is greedy)")
  args.tree = args.tree or [[4, 16, 16, 16, 16]]
  args.tree_attention = args.tree_attention or ["xla"]
  return args


def _drafts(specs: list[str]) -> list[tuple[str, str]]:
  named = []
  for spec in specs:
    name, _, path = spec.rpartition("=")
    named.append((name or os.path.basename(os.path.normpath(path)), path))
  return named


def _prompts(config, tokenizer, length: int, count: int, new_tokens: int, batch: int = 1) -> list[np.ndarray]:
  """count + 1 batches [batch, length] of different prompts (the first batch is the warm-up)
  from the validation split."""
  stride = length + new_tokens
  needed = stride * (count + 1) * batch
  stream = validation_tokens(config, tokenizer, needed)
  if stream.size < needed:
    print(f"note: the validation split has {stream.size} tokens; prompts repeat it", file=sys.stderr)
    stream = np.resize(stream, needed)
  pieces = [stream[i * stride : i * stride + length] for i in range((count + 1) * batch)]
  return [np.stack(pieces[i * batch : (i + 1) * batch]) for i in range(count + 1)]


def _autoregressive(target, prompt, new_tokens, temperature, seed):
  """(new tokens [batch, new_tokens], decode seconds)."""
  prompt = jnp.asarray(prompt, jnp.int32)
  caches = prefill_caches(target.model, target.params, prompt[:, :-1], prompt.shape[1] + new_tokens)
  jax.block_until_ready(caches)
  start = time.perf_counter()
  tokens, _ = jax.block_until_ready(
    continue_decoding(
      target.model,
      target.params,
      caches,
      prompt[:, -1],
      jnp.int32(prompt.shape[1] - 1),
      jax.random.key(seed),
      new_tokens,
      temperature,
    )
  )
  return np.asarray(tokens), time.perf_counter() - start


def _in_dtype(trained: TrainedModel, dtype: str | None) -> TrainedModel:
  if dtype is None:
    return trained
  return trained._replace(model=build_model(dataclasses.replace(trained.model.config, dtype=dtype)))


def _first_difference(a: np.ndarray, b: np.ndarray) -> int | None:
  differ = np.nonzero(a.reshape(-1) != b.reshape(-1))[0]
  return int(differ[0]) if differ.size else None


def run(args) -> list[dict]:
  try:
    target = load_trained_model(args.target_workdir)
    config = read_config(args.target_workdir)
    drafts = [
      (name, _in_dtype(load_draft(path, target, step=args.draft_step), args.dtype))
      for name, path in _drafts(args.draft)
    ]
  except (FileNotFoundError, ValueError, CheckpointError) as e:
    raise cl.UsageError(f"--target_workdir={args.target_workdir} / --draft={args.draft}: {e}") from e
  target = _in_dtype(target, args.dtype)
  rows = []
  for batch in args.batch_sizes:
    for length in args.prompt_lengths:
      rows += _measure_length(args, target, config, drafts, batch, length)
  return rows


def _measure_length(args, target, config, drafts, batch: int, length: int) -> list[dict]:
  rows = []
  prompts = _prompts(config, target.tokenizer, length, args.prompts, args.new_tokens, batch)
  new_tokens = args.new_tokens * batch * (len(prompts) - 1)  # timed, over every row
  for temperature in args.temperatures:
    _autoregressive(target, prompts[0], args.new_tokens, temperature, 0)  # compile
    baseline = [_autoregressive(target, p, args.new_tokens, temperature, i) for i, p in enumerate(prompts[1:])]
    base_tps = new_tokens / sum(seconds for _, seconds in baseline)
    for name, draft in drafts:
      for tree in args.tree:
        for implementation in args.tree_attention:
          call = lambda prompt, seed: speculative_generate(
            target.model,
            target.params,
            draft.model,
            draft.params,
            jnp.asarray(prompt, jnp.int32),
            max_new_tokens=args.new_tokens,
            tree=tuple(tree),
            temperature=temperature,
            rng=jax.random.key(seed),
            tree_attention_impl=implementation,
          )
          call(prompts[0], 0)  # compile
          results = [call(p, i) for i, p in enumerate(prompts[1:])]
          differences = [_first_difference(np.asarray(r.tokens[:, length:]), b) for r, (b, _) in zip(results, baseline)]
          identical = all(d is None for d in differences) if temperature == 0 else None
          row = {
            "batch": batch,
            "prompt_length": length,
            "temperature": temperature,
            "draft": name,
            "draft_step": draft.step,
            "tree": tree,
            "tree_attention": implementation,
            # Tokens per row verification (at batch 1, per target forward).
            "tau": float(np.mean([r.mean_accepted for r in results])),
            "target_forwards": sum(r.rounds for r in results),
            "tokens_per_s": new_tokens / sum(r.decode_seconds for r in results),
            "autoregressive_tokens_per_s": base_tps,
            "identical_to_autoregressive": identical,
            "first_difference": differences if temperature == 0 else None,
            "dtype": target.model.config.dtype,
            "draft_state_bytes": sum(x.nbytes for x in jax.tree.leaves(results[0].draft_cache)),
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
          }
          row["speedup"] = row["tokens_per_s"] / base_tps
          rows.append(row)
          print(json.dumps(row), file=sys.stderr, flush=True)
  return rows


def main(argv) -> list[dict]:
  args = parse_args(argv)
  precision = "highest" if args.dtype == "float32" else None
  with jax.default_matmul_precision(precision):
    rows = run(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(rows, f, indent=2)
  table = [
    [
      r["batch"],
      r["prompt_length"],
      r["temperature"],
      r["dtype"],
      r["draft"],
      ",".join(map(str, r["tree"])),
      r["tree_attention"],
      f"{r['tau']:.2f}",
      f"{r['tokens_per_s']:.1f}",
      f"{r['autoregressive_tokens_per_s']:.1f}",
      f"{r['speedup']:.2f}x",
      {None: "-", True: "yes", False: "NO"}[r["identical_to_autoregressive"]],
    ]
    for r in rows
  ]
  print(
    format_table(
      [
        "batch",
        "prompt",
        "T",
        "dtype",
        "draft",
        "tree",
        "attention",
        "tau",
        "tok/s",
        "AR tok/s",
        "speedup",
        "same as AR",
      ],
      table,
    )
  )
  return rows


if __name__ == "__main__":
  sys.exit(cl.run(main))
