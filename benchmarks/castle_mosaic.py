"""The CASTLE forward on Pallas Mosaic GPU next to cuDNN's causal attention forward and the
Triton CASTLE forward, in one process (medians of --iters calls after a warm-up).

    python benchmarks/castle_mosaic.py [--shapes=16x2048,2x16384] [--heads=16] [--head_dim=128]

The Mosaic kernel (`pallas_kernels.castle.mosaic_ops.castle_forward_mosaic`) is forward
only and not yet an implementation of `castle_attention`; this script measures it before
it is wired in. Prints one line per shape and kernel: ms, ratio to cuDNN, TFLOP/s
(CASTLE forward counted as 3x a causal attention forward of the same shape).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from castle_jax.ops.castle import castle_attention  # noqa: E402
from pallas_kernels.castle.mosaic_ops import castle_forward_mosaic  # noqa: E402
from timing import error_text, median_ms  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="16x2048,2x16384", help="batch x seq, comma-separated")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--window", type=int, default=None)
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args(argv)
  for text in args.shapes.split(","):
    batch, seq = (int(x) for x in text.split("x"))
    shape = (batch, seq, args.heads, args.head_dim)
    xs = [jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in jax.random.split(jax.random.key(0), 6)]
    causal_flops = 2 * batch * args.heads * seq * seq * args.head_dim  # two products, half the square
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    base = median_ms(cudnn, [tuple(xs[3:])], args.iters)
    print(f"{batch}x{seq}: cuDNN causal fwd {base:.2f} ms ({causal_flops / base / 1e9:.0f} TFLOP/s)", flush=True)
    kernels = (("mosaic", lambda *a: castle_forward_mosaic(*a, scale=args.head_dim ** -0.5, window=args.window).out),
               ("triton", lambda *a: castle_attention(*a, window=args.window, implementation="pallas")))
    for name, fn in kernels:
      try:
        ms = median_ms(jax.jit(fn), [tuple(xs)], args.iters)
        print(f"{batch}x{seq}: CASTLE {name} fwd {ms:.2f} ms = {ms / base:.2f}x cuDNN "
              f"({3 * causal_flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
      except Exception as e:  # one failing kernel must not lose the other's line
        print(f"{batch}x{seq}: CASTLE {name} fwd failed: {error_text(e)}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
