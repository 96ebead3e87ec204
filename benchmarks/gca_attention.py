"""Grouped cross attention (GCA) forward and forward+backward, next to the decoder's
sliding-window ALiBi self-attention over the same tokens.

    python benchmarks/gca_attention.py [--tokens=16384,65536] [--batch=4] [--heads=12] \
        [--head_dim=64] [--chunk=64] [--top_k=8] [--impls=xla,reference] [--window_impls=cudnn,cudnn_plain,xla] [--json=out.json]

The DRT layout: each chunk of `--chunk` real tokens plus its landmark is one query chunk
(chunk + 1 positions); each query chunk attends to `--top_k` memory chunks of `--chunk`
keys (the landmark row is the softmax_1's implicit zero logit), indices and weights drawn
at random (retrieval is not timed). Gradients: q, chunk keys/values and chunk weights.

FLOPs per forward: 4 * positions * heads * top_k * chunk * head_dim (two products per
retrieved chunk); the backward recomputes P and O' and adds four products (x2.5 the
forward; 3.5x in all). Prints a table last; median of --iters calls.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from castle_jax.ops.attention.alibi import alibi_window_attention
from castle_jax.ops.gca import gca_attention
from timing import error_text, run_meta, time_forward_and_gradients, write_json


def gca_inputs(batch, tokens, heads, head_dim, chunk, top_k, dtype, seed):
  chunks = tokens // chunk
  positions = chunks * (chunk + 1)
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (batch, positions, heads, head_dim), dtype)
  chunk_k = jax.random.normal(keys[1], (batch, chunks, chunk, heads, head_dim), dtype)
  chunk_v = jax.random.normal(keys[2], (batch, chunks, chunk, heads, head_dim), dtype)
  weights = jax.nn.softmax(jax.random.normal(keys[3], (batch, chunks, top_k)), axis=-1)
  indices = jax.random.randint(keys[4], (batch, chunks, top_k), 0, chunks)
  cotangent = jax.random.normal(keys[5], q.shape, dtype)
  return q, chunk_k, chunk_v, weights, indices, cotangent


def gca_row(impl, batch, tokens, heads, head_dim, chunk, top_k, dtype, iters):
  sets = [gca_inputs(batch, tokens, heads, head_dim, chunk, top_k, dtype, seed) for seed in range(2)]
  positions = sets[0][0].shape[1]

  indices = sets[0][4]  # not differentiated: one set of random retrievals for every call

  def fn(q, chunk_k, chunk_v, weights):
    return gca_attention(q, chunk_k, chunk_v, weights, indices, implementation=impl)

  timings = time_forward_and_gradients(fn, 4, [s[:4] + (s[5],) for s in sets], iters)
  flops = 4 * batch * positions * heads * top_k * chunk * head_dim
  row = {"impl": f"gca_{impl}", "tokens": tokens, "positions": positions, **timings, "fwd_gflop": flops / 1e9}
  if "fwd_ms" in timings:
    row["fwd_tflops"] = flops / timings["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3.5 * flops / timings["fwd_bwd_ms"] / 1e9
  return row


def window_row(impl, batch, tokens, heads, head_dim, chunk, window, dtype, iters):
  """The decoder's self-attention over the same positions: sliding window with ALiBi
  (`alibi_window_attention`, impl "xla" or "cudnn"), or "cudnn_plain", cuDNN's own
  causal local window without ALiBi (what the blockwise layout costs on top)."""
  positions = tokens // chunk * (chunk + 1)
  sets = []
  for seed in range(2):
    keys = jax.random.split(jax.random.key(10 + seed), 4)
    sets.append(tuple(jax.random.normal(k, (batch, positions, heads, head_dim), dtype) for k in keys))

  def fn(q, k, v):
    if impl == "cudnn_plain":
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(window - 1, 0),
                                          implementation="cudnn")
    return alibi_window_attention(q, k, v, window=window, implementation=impl)

  # Visible keys per query ~ window: 4 * window * head_dim FLOPs per query and head.
  flops = 4 * batch * positions * heads * window * head_dim
  timings = time_forward_and_gradients(fn, 3, sets, iters)
  row = {"impl": f"window_{window}_{impl}", "tokens": tokens, "positions": positions, **timings}
  if "fwd_ms" in timings:
    row["fwd_tflops"] = flops / timings["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3.5 * flops / timings["fwd_bwd_ms"] / 1e9
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", default="16384,65536", help="real tokens per sequence")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--chunk", type=int, default=64)
  parser.add_argument("--top_k", type=int, default=8)
  parser.add_argument("--window", type=int, default=512, help="sliding window of the self-attention rows")
  parser.add_argument("--window_impls", default="cudnn,cudnn_plain,xla",
                      help="self-attention rows: ALiBi window on 'cudnn'/'xla', 'cudnn_plain' (no ALiBi); '' for none")
  parser.add_argument("--impls", default="xla", help="comma-separated GCA implementations")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  rows = []
  for tokens in (int(x) for x in args.tokens.split(",")):
    for impl in args.impls.split(","):
      rows.append(gca_row(impl, args.batch, tokens, args.heads, args.head_dim, args.chunk, args.top_k, dtype,
                          args.iters))
      print(rows[-1], flush=True)
    for impl in args.window_impls.split(",") if args.window_impls else ():
      try:
        rows.append(window_row(impl, args.batch, tokens, args.heads, args.head_dim, args.chunk, args.window, dtype,
                               args.iters))
      except Exception as e:  # report and go on
        rows.append({"impl": f"window_{args.window}_{impl}", "tokens": tokens, "error": error_text(e)})
      print(rows[-1], flush=True)
  write_json(args.json, run_meta(**vars(args)), rows=rows)
  print(f"\n| {jax.devices()[0].device_kind} | batch {args.batch} | {args.heads} x {args.head_dim} | chunk "
        f"{args.chunk} | k {args.top_k} | {args.dtype} |")
  print("| impl | tokens | fwd ms | fwd+bwd ms | fwd / fwd+bwd TFLOP/s | peak GiB |")
  print("| --- | --- | --- | --- | --- | --- |")
  for r in rows:
    if "error" in r:
      print(f"| {r['impl']} | {r['tokens']} | {r['error']} |")
      continue
    rates = (f"{r['fwd_tflops']:.1f} / {r['fwd_bwd_tflops']:.1f}" if "fwd_tflops" in r else "-")
    print(f"| {r['impl']} | {r['tokens']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {rates} | "
          f"{r['peak_gib']:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
