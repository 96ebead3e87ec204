"""The CASTLE forward on Pallas Mosaic GPU (both schedules) next to cuDNN's causal attention
forward and the Triton CASTLE forward, in one process (medians of --iters calls after a
warm-up).

    python -m benchmarks.castle_mosaic [--runs=16x2048,2x16384,2x16384/512] [--heads=16]
        [--head_dim=128] [--iters=20] [--json=out.json]

Each run is batch x seq, with "/W" for CASTLE-SWL with window W. The Mosaic kernel
(`pallas_kernels.castle.mosaic_ops.castle_forward_mosaic`) is forward only and not yet an
implementation of `castle_attention`. Prints one row per run and kernel (ms, ratio to the
cuDNN causal forward of the same shape, TFLOP/s) and a table last; a failing kernel
prints its error and the others go on.

FLOPs: cuDNN causal forward 2 products over the causal triangle, 2 * B*H*T^2*d. CASTLE
counts 6 products of the same size (3x). CASTLE-SWL counts the 3 products that every
(query, key) pair needs (S^C, S^U = Q^C D^T, P V^C) over the triangle and the 3 lookahead
products (W, W R^T, D's step) over the T x W band only: 1.5 * causal + 6 * B*H*T*W*d.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp


from castle_jax import command_line as cl  # noqa: E402
from castle_jax.ops.castle import castle_attention  # noqa: E402
from pallas_kernels.castle import CastleKernelConfig  # noqa: E402
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig  # noqa: E402
from pallas_kernels.castle.mosaic_ops import castle_forward_mosaic  # noqa: E402
from benchmarks.timing import error_text, median_ms, run_meta, write_json  # noqa: E402

# The Triton rows ask for the Triton kernels: backend 'auto' may pick Mosaic.
TRITON = CastleKernelConfig(backend="triton")


def parse_run(text: str):
  """ "BxT" or "BxT/W" -> (batch, seq, window or None)."""
  shape, _, window = text.partition("/")
  batch, seq = (int(x) for x in shape.split("x"))
  return batch, seq, int(window) if window else None


def parse_runs(text: str) -> list[tuple[int, int, int | None]]:
  """ "16x2048,2x16384/512" -> [(16, 2048, None), (2, 16384, 512)]; ValueError for a bad entry."""
  runs = [parse_run(part) for part in text.split(",")]
  if any(value is not None and value < 1 for run in runs for value in run):
    raise ValueError("every size must be >= 1")
  return runs


def castle_flops(batch, seq, heads, head_dim, window):
  causal = 2 * batch * heads * seq * seq * head_dim
  if window is None:
    return 3 * causal
  return 1.5 * causal + 6 * batch * heads * seq * min(window, seq) * head_dim


def kernels(head_dim, window):
  """(name, forward fn of the six projections) for each CASTLE forward."""

  def mosaic(schedule, past_window="query_major"):
    config = CastleMosaicConfig(schedule=schedule, past_window=past_window)
    return lambda *a: castle_forward_mosaic(*a, scale=head_dim**-0.5, window=window, config=config).out

  past_window_rows = (
    ()
    if window is None
    else (("mosaic warp_specialized, past window key-major", mosaic("warp_specialized", "key_major")),)
  )
  return (
    ("mosaic warp_specialized", mosaic("warp_specialized")),
    *past_window_rows,
    ("mosaic simple", mosaic("simple")),
    ("triton", lambda *a: castle_attention(*a, window=window, implementation="pallas", pallas_config=TRITON)),
  )


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--runs",
    type=cl.parsed_by(parse_runs, "comma-separated BxT or BxT/W, e.g. 16x2048,2x16384/512"),
    default="16x2048,2x16384,2x16384/512",
    help="batch x seq[/window], comma-separated",
  )
  parser.add_argument("--heads", type=cl.positive_int, default=16)
  parser.add_argument("--head_dim", type=cl.positive_int, default=128)
  parser.add_argument("--iters", type=cl.positive_int, default=20)
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  rows = []
  baselines = {}
  for batch, seq, window in args.runs:
    label = f"{batch}x{seq}" + (f" SWL {window}" if window else "")
    shape = (batch, seq, args.heads, args.head_dim)
    xs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in jax.random.split(jax.random.key(0), 6)]
    causal_flops = 2 * batch * args.heads * seq * seq * args.head_dim
    if (batch, seq) not in baselines:
      try:
        cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
        baselines[batch, seq] = median_ms(cudnn, [tuple(xs[3:])], args.iters)
        rows.append(
          dict(
            run=f"{batch}x{seq}",
            kernel="cuDNN causal fwd",
            ms=baselines[batch, seq],
            ratio=1.0,
            tflops=causal_flops / baselines[batch, seq] / 1e9,
          )
        )
      except Exception as e:  # the CASTLE rows still print their ms
        baselines[batch, seq] = None
        rows.append(dict(run=f"{batch}x{seq}", kernel="cuDNN causal fwd", error=error_text(e)))
      print(rows[-1], flush=True)
    base = baselines[batch, seq]
    flops = castle_flops(batch, seq, args.heads, args.head_dim, window)
    for name, fn in kernels(args.head_dim, window):
      try:
        ms = median_ms(jax.jit(fn), [tuple(xs)], args.iters)
        rows.append(
          dict(run=label, kernel=f"CASTLE {name}", ms=ms, ratio=ms / base if base else None, tflops=flops / ms / 1e9)
        )
      except Exception as e:  # one failing kernel must not lose the other rows
        rows.append(dict(run=label, kernel=f"CASTLE {name}", error=error_text(e)))
      print(rows[-1], flush=True)

  print(f"\nforward, bf16, {args.heads} heads x {args.head_dim}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| run | kernel | ms | x cuDNN causal fwd | TFLOP/s |\n| --- | --- | --- | --- | --- |")
  for row in rows:
    if "error" in row:
      print(f"| {row['run']} | {row['kernel']} | failed: {row['error']} | | |")
    else:
      ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
      print(f"| {row['run']} | {row['kernel']} | {row['ms']:.2f} | {ratio} | {row['tflops']:.0f} |")
  write_json(args.json, run_meta(heads=args.heads, head_dim=args.head_dim, iters=args.iters), rows=rows)
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
