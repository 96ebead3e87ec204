"""Where the CASTLE Mosaic GPU backward's steps spend their cycles (H100, on-device profiler).

    python benchmarks/castle_mosaic_profile.py [--heads=2] [--seq=16384] [--window=512|none] \
        [--ranges=48] [--trace_dir=/tmp/castle_traces] [--past_window=query_major|key_major]

Runs the key-major backward kernel (`mosaic_backward`) once on [heads, seq, 128] bf16
inputs with Mosaic GPU's profiler on (`pallas_kernels.castle.mosaic_profile`), and prints
per named phase of a step ("lookahead: ..." for the steps that walk D back, "past window:
..." for CASTLE-SWL's steps past a key's window) the median and mean SM cycles and the
share of each warpgroup's recorded time (warpgroup 0 computes the scores, 1 accumulates
dK^C, dV^C, dQ^U). Each program records its first --ranges regions per warpgroup; the
sweep runs in reverse, so without a window every recorded step walks D back, and with one
the early key blocks record past-window steps and the last ones steps inside the window.
The trace itself (Perfetto / chrome://tracing) stays in --trace_dir.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from castle_mosaic_swl_kernels import kernel_inputs  # noqa: E402
from pallas_kernels.castle import mosaic_backward, mosaic_profile  # noqa: E402
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig  # noqa: E402

_BACKWARD_WARPGROUPS = 2


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--heads", type=int, default=2, help="batch x heads")
  parser.add_argument("--seq", type=int, default=16384)
  parser.add_argument("--window", default="512", help="CASTLE-SWL window, or 'none' for CASTLE")
  parser.add_argument("--ranges", type=int, default=48, help="named ranges recorded per warpgroup and program")
  parser.add_argument("--past_window", default="query_major", choices=("query_major", "key_major"))
  parser.add_argument("--trace_dir", default="/tmp/castle_traces")
  args = parser.parse_args(argv)
  window = None if args.window.lower() == "none" else int(args.window)
  data = kernel_inputs(args.heads, args.seq, window)
  config = CastleMosaicConfig(past_window=args.past_window)
  with mosaic_profile.recording(args.trace_dir, ranges_per_warpgroup=args.ranges):
    backward = jax.jit(lambda *a: mosaic_backward.backward(
        *a, data.lookahead_keys, data.d_out, data.lse, data.delta, data.in_block_t, scale=data.scale,
        window=window, config=config, interpret=None))
    jax.block_until_ready(backward(*data.inputs))
  jax.effects_barrier()  # the trace is written by a host callback
  # The split backward also runs the query-major dQ^C kernel, whose trace has no step phases.
  trace = mosaic_profile.latest_trace(args.trace_dir, containing="lookahead: " if window is None else "past window: ")
  print(f"\n{args.heads} x {args.seq} x 128, window {window}, {jax.devices()[0].device_kind}, jax {jax.__version__}; "
        f"trace {trace}")
  print(mosaic_profile.phase_table(trace, _BACKWARD_WARPGROUPS))
  return 0


if __name__ == "__main__":
  sys.exit(main())
