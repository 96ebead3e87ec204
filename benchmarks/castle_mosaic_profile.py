"""Where the CASTLE Mosaic GPU backward's steps spend their cycles (H100, on-device profiler).

    python -m benchmarks.castle_mosaic_profile [--kernel=key_major_sweep|key_side|query_grads] \
        [--heads=2] [--seq=16384] [--window=512|none] [--ranges=24] [--trace_dir=/tmp/castle_traces] \
        [--past_window=query_major|key_major]

Runs one backward kernel once on [heads, seq, 128] bf16 inputs with Mosaic GPU's profiler
on (`pallas_kernels.castle.mosaic_profile`) and prints, per named phase of a step, the
median and mean SM cycles and the share of each warpgroup's recorded time:
  - key_major_sweep (`mosaic_backward`, the backward over every pair or, for CASTLE-SWL,
    inside the window): "lookahead: ..." for the steps that walk D back, "past window:
    ..." for CASTLE-SWL's steps past a key's window; warpgroup 0 computes the scores, 1
    accumulates dK^C, dV^C, dQ^U. The sweep runs in reverse, so without a window every
    recorded step walks D back, and with one the early key blocks record past-window steps
    and the last ones steps inside the window.
  - key_side (`mosaic_past_window_backward.key_grads`, CASTLE-SWL): warpgroup 0 computes
    the scores, 1 accumulates dK^C, dV^C, dD, 2 streams the query tiles.
  - query_grads (`mosaic_past_window_backward.accumulate_query_grads`, CASTLE-SWL): two
    consumer warpgroups and the producer.
Each program records its first --ranges regions per warpgroup (the key-major sweep leaves
~1 KB of shared memory: 24 ranges). The trace itself (Perfetto / chrome://tracing) stays
in --trace_dir.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp


from benchmarks.castle_mosaic_swl_kernels import kernel_inputs  # noqa: E402
from castle_jax import command_line as cl  # noqa: E402
from pallas_kernels.castle import mosaic_backward, mosaic_forward, mosaic_past_window_backward  # noqa: E402
from pallas_kernels.castle import mosaic_profile  # noqa: E402
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig  # noqa: E402

# Per kernel: warpgroups per program, and a phase-name prefix that only its trace has.
KERNELS = {"key_major_sweep": (2, None), "key_side": (3, "key side: "), "query_grads": (3, "dQ^C: ")}


def kernel_call(kernel: str, data, window, config):
  """The function of the six inputs (q_u, k_u, v_u, q_c, k_c, v_c) that runs `kernel` on
  `data` (`castle_mosaic_swl_kernels.KernelInputs`)."""
  past = dict(scale=data.scale, window=window, block_q=64, block_k=64, keys_per_program=128, interpret=None)
  residuals = (data.lookahead_keys, data.d_out, data.lse, data.delta)
  if kernel == "key_major_sweep":
    return lambda *a: mosaic_backward.backward(
      *a, *residuals, data.in_block_t, scale=data.scale, window=window, config=config, interpret=None
    )
  keys, d_out, lse, delta = residuals
  if kernel == "key_side":
    return lambda q_u, k_u, v_u, q_c, k_c, v_c: mosaic_past_window_backward.key_grads(
      q_c, k_c, keys, v_c, d_out, lse, delta, **past
    )
  return lambda q_u, k_u, v_u, q_c, k_c, v_c: mosaic_forward.run_on_zeroed_refs(
    lambda dq_ref: mosaic_past_window_backward.accumulate_query_grads(
      q_c, k_c, keys, v_c, d_out, lse, delta, dq_ref, **past
    ),
    (jax.ShapeDtypeStruct(q_c.shape, jnp.float32),),
  )


def _window(text: str) -> int | None:
  return None if text.lower() == "none" else cl.positive_int(text)


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--kernel", default="key_major_sweep", choices=tuple(KERNELS))
  parser.add_argument("--heads", type=cl.positive_int, default=2, help="batch x heads")
  parser.add_argument("--seq", type=cl.positive_int, default=16384)
  parser.add_argument("--window", type=_window, default="512", help="CASTLE-SWL window, or 'none' for CASTLE")
  parser.add_argument(
    "--ranges", type=cl.positive_int, default=24, help="named ranges recorded per warpgroup and program"
  )
  parser.add_argument("--past_window", default="query_major", choices=("query_major", "key_major"))
  parser.add_argument("--trace_dir", default="/tmp/castle_traces")
  args = parser.parse_args(argv)
  window = args.window
  if window is None and args.kernel != "key_major_sweep":
    parser.error(f"--kernel={args.kernel} runs CASTLE-SWL's pairs past the window: give --window")
  data = kernel_inputs(args.heads, args.seq, window)
  call = kernel_call(args.kernel, data, window, CastleMosaicConfig(past_window=args.past_window))
  with mosaic_profile.recording(args.trace_dir, ranges_per_warpgroup=args.ranges):
    jax.block_until_ready(jax.jit(call)(*data.inputs))
  jax.effects_barrier()  # the trace is written by a host callback
  warpgroups, prefix = KERNELS[args.kernel]
  if prefix is None:  # the split backward also runs other kernels, whose traces have other phases
    prefix = "lookahead: " if window is None else "past window: "
  trace = mosaic_profile.latest_trace(args.trace_dir, containing=prefix)
  print(
    f"\n{args.kernel}, {args.heads} x {args.seq} x 128, window {window}, {jax.devices()[0].device_kind}, "
    f"jax {jax.__version__}; trace {trace}"
  )
  print(mosaic_profile.phase_table(trace, warpgroups))
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
