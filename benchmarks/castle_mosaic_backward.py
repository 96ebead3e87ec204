"""CASTLE forward + backward on Pallas Mosaic GPU next to cuDNN causal attention and the
Triton CASTLE kernels, in one process (medians of --iters calls after a warm-up).

    python -m benchmarks.castle_mosaic_backward [--shapes=16x2048,2x16384] [--heads=16] \\
        [--castle_heads=16] [--head_dim=128] [--window=512] [--skip=triton,key-major] [--json=out.json]

Rows: cuDNN causal attention (`jax.nn.dot_product_attention(implementation="cudnn")`,
--heads heads; the ratios' baseline, full causal also with --window, plus a row of
cuDNN's own local window), `castle_attention_mosaic` (the Mosaic GPU forward and backward
kernels; with --window also with the past-window pairs' key side in the key-major sweep
(`past_window_key_grads="key_major_sweep"`) and with every pair swept key-major
(`past_window="key_major"`)) and the Triton CASTLE kernels
(`castle_attention(implementation="pallas")`), --castle_heads heads each;
fwd and fwd+bwd (gradients of all inputs) times, and fwd+bwd as a multiple of cuDNN's.
TFLOP/s count the matmuls as built, in units of one product over the causal half of
the score matrix (B H T^2 d FLOPs): causal attention 2 forward + 5 backward, CASTLE
6 forward + 17 backward; under a window the counts stay those of full causal attention
(an upper bound of the work). Each row runs in its own try/except. Prints a table last.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp


from castle_jax import command_line as cl  # noqa: E402
from castle_jax.ops.castle import castle_attention  # noqa: E402
from pallas_kernels.castle import CastleKernelConfig  # noqa: E402
from pallas_kernels.castle.mosaic_attention import castle_attention_mosaic  # noqa: E402
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig  # noqa: E402
from benchmarks.castle_mosaic import parse_runs  # noqa: E402
from benchmarks.timing import run_meta, time_forward_and_gradients, write_json  # noqa: E402

# The Triton rows ask for the Triton kernels: backend 'auto' may pick Mosaic.
TRITON = CastleKernelConfig(backend="triton")

# Matmul products over the causal half of the scores (B H T^2 d FLOPs each), fwd + bwd.
_CAUSAL_PRODUCTS = 2 + 5
_CASTLE_PRODUCTS = 6 + 17


def _shapes(text: str) -> list[tuple[int, int]]:
  """ "16x2048,2x16384" -> [(16, 2048), (2, 16384)] (the window is --window)."""
  runs = parse_runs(text)
  if any(window is not None for _, _, window in runs):
    raise ValueError("give the window with --window")
  return [(batch, seq) for batch, seq, _ in runs]


def _inputs(seed: int, shape, count: int):
  keys = jax.random.split(jax.random.key(seed), count + 1)
  return tuple(jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in keys)


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--shapes",
    type=cl.parsed_by(_shapes, "comma-separated BxT, e.g. 16x2048,2x16384"),
    default="16x2048,2x16384",
    help="batch x seq, comma-separated",
  )
  parser.add_argument("--heads", type=cl.positive_int, default=16, help="cuDNN heads")
  parser.add_argument("--castle_heads", type=cl.positive_int, default=16, help="CASTLE heads (the XL model has 9)")
  parser.add_argument("--head_dim", type=cl.positive_int, default=128)
  parser.add_argument(
    "--window", type=cl.positive_int, default=None, help="CASTLE-SWL window (cuDNN's baseline row stays full causal)"
  )
  parser.add_argument("--iters", type=cl.positive_int, default=20)
  parser.add_argument(
    "--skip", default=None, help="comma-separated words: rows whose name contains one are skipped (cuDNN always runs)"
  )
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  window = args.window
  rows = []
  for batch, seq in args.shapes:
    causal_pairs = batch * seq * seq * args.head_dim  # FLOPs of one product per head
    cudnn_shape = (batch, seq, args.heads, args.head_dim)
    castle_shape = (batch, seq, args.castle_heads, args.head_dim)
    cudnn = lambda local: (
      lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn", local_window_size=local
      )
    )
    mosaic = lambda **config: lambda *a: castle_attention_mosaic(*a, window=window, config=CastleMosaicConfig(**config))
    candidates = [
      ("cuDNN", args.heads, _CAUSAL_PRODUCTS, 3, cudnn_shape, cudnn(None)),
      ("CASTLE mosaic", args.castle_heads, _CASTLE_PRODUCTS, 6, castle_shape, mosaic()),
    ]
    if window is not None:
      # The baseline stays full causal attention; these rows show the window's own
      # cuDNN time and the Mosaic forward that sweeps every pair key-major.
      candidates[1:1] = [("cuDNN window", args.heads, _CAUSAL_PRODUCTS, 3, cudnn_shape, cudnn((window, 0)))]
      candidates.append(
        (
          "CASTLE mosaic, past window's key side in the key-major sweep",
          args.castle_heads,
          _CASTLE_PRODUCTS,
          6,
          castle_shape,
          mosaic(past_window_key_grads="key_major_sweep"),
        )
      )
      candidates.append(
        (
          "CASTLE mosaic, past window key-major",
          args.castle_heads,
          _CASTLE_PRODUCTS,
          6,
          castle_shape,
          mosaic(past_window="key_major"),
        )
      )
    candidates.append(
      (
        "CASTLE triton",
        args.castle_heads,
        _CASTLE_PRODUCTS,
        6,
        castle_shape,
        lambda *a: castle_attention(*a, window=window, implementation="pallas", pallas_config=TRITON),
      )
    )
    base = None
    for name, heads, products, num_inputs, shape, fn in candidates:
      if args.skip and any(word in name for word in args.skip.split(",")) and name != "cuDNN":
        continue
      args_sets = [_inputs(seed, shape, num_inputs) for seed in range(2)]
      result = time_forward_and_gradients(fn, num_inputs, args_sets, args.iters)
      row = {"shape": f"{batch}x{seq}x{heads}x{args.head_dim}", "kernel": name, **result}
      if "error" not in result:
        row["tflops"] = products * causal_pairs * heads / result["fwd_bwd_ms"] / 1e9
        if name == "cuDNN":
          base = result["fwd_bwd_ms"]
        elif base is not None:
          row["x_cudnn"] = result["fwd_bwd_ms"] / base
      print(row, flush=True)
      rows.append(row)

  print(
    f"\n| shape (BxTxHxd) | kernel | fwd ms | fwd+bwd ms | x cuDNN fwd+bwd | TFLOP/s (fwd+bwd) |"
    f"{'' if window is None else f'  window {window}'}"
  )
  print("| --- | --- | --- | --- | --- | --- |")
  for row in rows:
    if "error" in row:
      print(f"| {row['shape']} | {row['kernel']} | failed: {row['error']} | | | |")
      continue
    ratio = f"{row['x_cudnn']:.2f}" if "x_cudnn" in row else "1.00" if row["kernel"] == "cuDNN" else "-"
    print(
      f"| {row['shape']} | {row['kernel']} | {row['fwd_ms']:.2f} | {row['fwd_bwd_ms']:.2f} | {ratio} | "
      f"{row['tflops']:.0f} |"
    )
  write_json(args.json, run_meta(window=window, iters=args.iters), rows=rows)
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
