"""Grouped cross attention (GCA): every implementation of the op next to cuDNN on the same
work and the decoder's sliding-window ALiBi self-attention over the same tokens.

    python -m benchmarks.gca_attention [--tokens=16384,65536] [--batch=4] [--heads=12] \
        [--head_dim=64] [--chunk=64] [--top_k=8] [--impls=xla,triton,mosaic,dense_cudnn] \
        [--kernel_configs="triton:block_rows=32,num_warps=4;mosaic:stages=3"] \
        [--window_impls=cudnn,cudnn_plain,xla] [--json=out.json]
    python -m benchmarks.gca_attention --smoke   # tiny shapes, any device (CI)

The DRT layout: each chunk of `--chunk` real tokens plus its landmark is one query chunk
(chunk + 1 positions); each query chunk attends to `--top_k` memory chunks of `--chunk`
keys (the landmark row is the softmax_1's implicit zero logit), indices and weights drawn
at random (retrieval is not timed). Gradients: q, chunk keys/values and chunk weights.
configs/drt_128m.py has chunk_size 63: --chunk=63 gives its shape (64 query positions
per chunk, memory chunks of 63 keys). `--impls` defaults to the op's implementations
(`castle_jax.ops.gca.IMPLEMENTATIONS`, but "reference") and the dense baseline;
`--kernel_configs` times an implementation once per config given (a sweep); without it,
its default config; an implementation that cannot run here is a row saying why.

FLOPs per forward: 4 * positions * heads * top_k * chunk * head_dim (two products per
retrieved chunk); the backward recomputes P and O' and adds four products (x2.5 the
forward; 3.5x in all: the algorithm's count, whatever an implementation recomputes; the
kernels run 9 products per retrieved chunk, i.e. 4.5x). "dense_cudnn" is the reference for
the kernels' rate: cuDNN flash attention on the same work laid out densely (each query
chunk over top_k * chunk contiguous keys: the same FLOPs and product shapes, no gather and
no softmax_1; "dense_xla" the same through XLA, off a GPU). Prints a table last; median of
--iters calls.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from castle_jax import command_line as cl
from castle_jax.ops.attention.alibi import alibi_window_attention
from castle_jax.ops.gca import gca_attention
from castle_jax.ops.gca import IMPLEMENTATIONS, KERNEL_CONFIGS
from benchmarks import timing


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


def with_rates(row: dict, timings: dict, flops: float) -> dict:
  """`row` plus fwd / fwd+bwd TFLOP/s for `flops` forward FLOPs (fwd+bwd counted as 3.5x),
  when the timings did not fail."""
  if "fwd_ms" in timings:
    row["fwd_tflops"] = flops / timings["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3.5 * flops / timings["fwd_bwd_ms"] / 1e9
  return row


def gca_row(impl, batch, tokens, heads, head_dim, chunk, top_k, dtype, iters, kernel_config=None, label=""):
  """The forward and gradients of `gca_attention(implementation=impl)`."""
  sets = [gca_inputs(batch, tokens, heads, head_dim, chunk, top_k, dtype, seed) for seed in range(2)]
  positions = sets[0][0].shape[1]

  indices = sets[0][4]  # not differentiated: one set of random retrievals for every call

  def fn(q, chunk_k, chunk_v, weights):
    return gca_attention(q, chunk_k, chunk_v, weights, indices, implementation=impl, kernel_config=kernel_config)

  timings = timing.time_forward_and_gradients(fn, 4, [s[:4] + (s[5],) for s in sets], iters)
  flops = 4 * batch * positions * heads * top_k * chunk * head_dim
  row = {"impl": f"gca_{impl}{label}", "tokens": tokens, "positions": positions, **timings, "fwd_gflop": flops / 1e9}
  return with_rates(row, timings, flops)


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
      return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(window - 1, 0), implementation="cudnn"
      )
    return alibi_window_attention(q, k, v, window=window, implementation=impl)

  # Visible keys per query ~ window: 4 * window * head_dim FLOPs per query and head.
  flops = 4 * batch * positions * heads * window * head_dim
  timings = timing.time_forward_and_gradients(fn, 3, sets, iters)
  row = {"impl": f"window_{window}_{impl}", "tokens": tokens, "positions": positions, **timings}
  return with_rates(row, timings, flops)


def dense_row(impl, batch, tokens, heads, head_dim, chunk, top_k, dtype, iters):
  """The same work as GCA without the retrieval: cuDNN's flash attention (impl "cudnn"; or
  "xla"), one sequence per
  (batch, query chunk), its chunk + 1 queries over top_k * chunk contiguous keys, no mask.
  Equal FLOPs and equal product shapes, so its TFLOP/s is the rate that the best dense
  kernel reaches on GCA's small per-chunk problems: the reference for GCA's kernels."""
  chunks = tokens // chunk
  sets = []
  for seed in range(2):
    keys = jax.random.split(jax.random.key(20 + seed), 4)
    q, cotangent = (jax.random.normal(key, (batch * chunks, chunk + 1, heads, head_dim), dtype) for key in keys[:2])
    k, v = (jax.random.normal(key, (batch * chunks, top_k * chunk, heads, head_dim), dtype) for key in keys[2:])
    sets.append((q, k, v, cotangent))

  def fn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation=impl)

  flops = 4 * batch * chunks * (chunk + 1) * heads * top_k * chunk * head_dim
  timings = timing.time_forward_and_gradients(fn, 3, sets, iters)
  row = {"impl": f"dense_same_work_{impl}", "tokens": tokens, "positions": chunks * (chunk + 1), **timings}
  return with_rates(row, timings, flops)


DENSE_IMPLS = ("dense_cudnn", "dense_xla")
WINDOW_IMPLS = ("cudnn", "cudnn_plain", "xla")


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__)
  parser.add_argument("--tokens", type=cl.positive_int_list, default="16384,65536", help="real tokens per sequence")
  parser.add_argument("--batch", type=cl.positive_int, default=4)
  parser.add_argument("--heads", type=cl.positive_int, default=12)
  parser.add_argument("--head_dim", type=cl.positive_int, default=64)
  parser.add_argument("--chunk", type=cl.positive_int, default=64)
  parser.add_argument("--top_k", type=cl.positive_int, default=8)
  parser.add_argument("--window", type=cl.positive_int, default=512, help="sliding window of the self-attention rows")
  parser.add_argument(
    "--window_impls",
    type=lambda text: cl.choice_list(WINDOW_IMPLS)(text) if text.strip() else [],
    default="cudnn,cudnn_plain,xla",
    help="self-attention rows: ALiBi window on 'cudnn'/'xla', 'cudnn_plain' (no ALiBi); '' for none",
  )
  parser.add_argument(
    "--impls",
    type=cl.choice_list((*IMPLEMENTATIONS, *DENSE_IMPLS)),
    default=None,
    help="comma-separated GCA implementations (reference, xla, triton, mosaic) and 'dense_cudnn' / 'dense_xla' "
    "(the same work as dense attention); default: the op's but reference, and the dense baseline",
  )
  parser.add_argument(
    "--kernel_configs",
    type=cl.parsed_by(
      lambda text: timing.kernel_config_specs(text, KERNEL_CONFIGS), "';'-separated 'impl:key=value,...'"
    ),
    default="",
    help="';'-separated 'impl:key=value,...' kernel configs, e.g. 'triton:block_rows=32;mosaic:stages=3': "
    "one row each (default: the implementation's default config)",
  )
  parser.add_argument("--iters", type=cl.positive_int, default=10)
  parser.add_argument("--dtype", choices=cl.DTYPES, default="bfloat16")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, one timed call: checks the harness runs")
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  if args.smoke:
    timing.smoke_mode()
    args.tokens, args.batch, args.heads, args.chunk, args.top_k, args.iters = [126], 1, 2, 63, 2, 1
    args.window, args.window_impls = 64, ["xla"]
  dense = "dense_cudnn" if jax.default_backend() == "gpu" else "dense_xla"
  impls = args.impls or [*timing.implementations_to_time(IMPLEMENTATIONS).split(","), dense]
  configs = args.kernel_configs
  dtype = jnp.dtype(args.dtype)
  shape = (args.heads, args.head_dim, args.chunk, args.top_k, dtype, args.iters)
  rows = []
  for tokens in args.tokens:
    for impl in impls:
      if impl in DENSE_IMPLS:
        try:
          rows.append(dense_row(impl.removeprefix("dense_"), args.batch, tokens, *shape))
        except Exception as e:  # report and go on
          rows.append({"impl": f"dense_same_work_{impl}", "tokens": tokens, "error": timing.error_text(e)})
      else:
        for spec, config in configs.get(impl, [("", None)]):
          rows.append(gca_row(impl, args.batch, tokens, *shape, config, f"[{spec}]" if spec else ""))
      print(rows[-1], flush=True)
    for impl in args.window_impls:
      try:
        rows.append(
          window_row(impl, args.batch, tokens, args.heads, args.head_dim, args.chunk, args.window, dtype, args.iters)
        )
      except Exception as e:  # report and go on
        rows.append({"impl": f"window_{args.window}_{impl}", "tokens": tokens, "error": timing.error_text(e)})
      print(rows[-1], flush=True)
  specs = {impl: [spec for spec, _ in pairs] for impl, pairs in configs.items()}
  timing.write_json(args.json, timing.run_meta(**(vars(args) | {"kernel_configs": specs})), rows=rows)
  print(
    f"\n| {jax.devices()[0].device_kind} | batch {args.batch} | {args.heads} x {args.head_dim} | chunk "
    f"{args.chunk} | k {args.top_k} | {args.dtype} |"
  )
  timing.print_table(
    rows,
    [
      ("impl", "impl", ""),
      ("tokens", "tokens", "d"),
      *timing.TIME_COLUMNS,
      timing.PEAK_COLUMN,
    ],
  )
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
