"""Time of each Mosaic GPU kernel of CASTLE-SWL's forward and backward, alone (H100).

    python -m benchmarks.castle_mosaic_swl_kernels [--heads=18] [--seq=16384] [--window=512] \
        [--iters=10] [--only=fwd,bwd]

Runs each kernel on [heads (batch x heads), seq, 128] bf16 inputs, medians of --iters
calls: the key-major forward over every pair and its window part alone (the sweep up to
`key_major_sweep_end`), the query-major forward kernel of the pairs past the window
(`mosaic_past_window`, with 128- and 64-key steps), both together, and the same for the backward (the key-major sweep
over every pair; the split backward, with the past-window key side in its own kernel (the
default) or in the key-major sweep; its query-major dQ^C kernel and its key-side kernel
alone). `--only`
keeps the rows whose name contains one of its comma-separated words. Prints a table last
with the TFLOP/s of the past-window kernels (their products over the past-window pairs).
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp


from castle_jax import command_line as cl  # noqa: E402
from pallas_kernels.castle import mosaic_backward, mosaic_forward, mosaic_past_window  # noqa: E402
from pallas_kernels.castle import mosaic_past_window_backward  # noqa: E402
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig  # noqa: E402
from pallas_kernels.castle.mosaic_ops import _in_block_scores_transposed  # noqa: E402
from benchmarks.timing import median_ms, run_meta, write_json  # noqa: E402

HEAD_DIM = 128


class KernelInputs(NamedTuple):
  """Random bf16 inputs of the kernels and the forward's residuals."""

  inputs: tuple  # q_u, k_u, v_u, q_c, k_c, v_c: [heads, seq, 128] bf16
  d_out: jax.Array  # [heads, seq, 128] bf16
  shift: jax.Array  # [heads, seq] float32, the forward's fixed softmax shift
  in_block_t: jax.Array  # [heads, seq, 64], the R_ii^T tiles
  lookahead_keys: jax.Array  # [heads, seq, 128] float32, the forward's final D
  lse: jax.Array  # [heads, seq] float32
  delta: jax.Array  # [heads, seq] float32, rowsum(out * d_out)
  scale: float


def kernel_inputs(heads: int, seq: int, window: int | None) -> KernelInputs:
  """Inputs for the kernels at [heads, seq, 128]; runs the key-major forward once."""
  scale = HEAD_DIM**-0.5
  keys = jax.random.split(jax.random.key(0), 7)
  inputs = tuple(jax.random.normal(k, (heads, seq, HEAD_DIM), jnp.float32).astype(jnp.bfloat16) for k in keys[:6])
  q_u, k_u, v_u, q_c, k_c, v_c = inputs
  d_out = (jax.random.normal(keys[6], (heads, seq, HEAD_DIM)) * 0.5).astype(jnp.bfloat16)
  shift = jnp.full((heads, seq), 3.0, jnp.float32)
  in_block_t = _in_block_scores_transposed(q_c, v_u, scale, 64)
  acc, sums, lookahead_keys = jax.jit(
    lambda *a: mosaic_forward.forward(
      *a,
      in_block_t,
      shift,
      config=CastleMosaicConfig(past_window="key_major"),
      scale=scale,
      window=window,
      interpret=None,
    )
  )(*inputs)
  lse = jnp.log(sums) + shift
  delta = jnp.sum(acc / sums[..., None] * d_out.astype(jnp.float32), -1)
  return KernelInputs(inputs, d_out, shift, in_block_t, lookahead_keys, lse, delta, scale)


def split_kernels(data: KernelInputs, window: int, step_keys: int = 128) -> dict:
  """Fresh jitted calls, each of the six inputs, of the CASTLE-SWL split's kernels alone on
  `data`'s residuals: "fwd_window" (the key-major forward up to `key_major_sweep_end`),
  "fwd_past" (the query-major forward past the window, `step_keys` keys per step),
  "bwd_dq" (the query-major dQ^C kernel) and "bwd_keys" (the key-side kernel). Fresh on
  every call, so that each traces the kernels' current code."""
  heads, seq, _ = data.inputs[0].shape
  keys, shift, scale = data.lookahead_keys, data.shift, data.scale
  residuals = (data.d_out, data.lse, data.delta)
  past = dict(scale=scale, window=window, block_q=64, block_k=64, keys_per_program=128, interpret=None)
  rows = jax.ShapeDtypeStruct((heads, seq, HEAD_DIM), jnp.float32)
  sums_type = jax.ShapeDtypeStruct((heads, seq), jnp.float32)
  return {
    "fwd_window": jax.jit(
      lambda *a: mosaic_forward.run_on_zeroed_refs(
        lambda *refs: mosaic_forward.forward_into(
          *a,
          data.in_block_t,
          shift,
          *refs,
          config=CastleMosaicConfig(),
          past_window=False,
          scale=scale,
          window=window,
          interpret=None,
        ),
        mosaic_forward.accumulator_types(a[3]),
      )
    ),
    "fwd_past": jax.jit(
      lambda *a: mosaic_forward.run_on_zeroed_refs(
        lambda acc_ref, sums_ref: mosaic_past_window.accumulate_past_window(
          a[3].astype(jnp.float16),
          a[4].astype(jnp.float16),
          keys,
          a[5],
          shift,
          acc_ref,
          sums_ref,
          **dict(past, block_k=step_keys),
        ),
        (rows, sums_type),
      )
    ),
    "bwd_dq": jax.jit(
      lambda *a: mosaic_forward.run_on_zeroed_refs(
        lambda dq_ref: mosaic_past_window_backward.accumulate_query_grads(
          a[3], a[4], keys, a[5], *residuals, dq_ref, **past
        ),
        (rows,),
      )
    ),
    "bwd_keys": jax.jit(lambda *a: mosaic_past_window_backward.key_grads(a[3], a[4], keys, a[5], *residuals, **past)),
  }


def past_window_pairs(heads: int, seq: int, window: int) -> int:
  """(query, key) pairs that the query-major kernels sweep."""
  programs = seq // 128
  keys = sum(min(max(128 * q - window, 0) // 128, q) * 128 for q in range(programs))
  return heads * keys * 128


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--heads", type=cl.positive_int, default=18, help="batch x heads")
  parser.add_argument("--seq", type=cl.positive_int, default=16384)
  parser.add_argument("--window", type=cl.positive_int, default=512)
  parser.add_argument("--iters", type=cl.positive_int, default=10)
  parser.add_argument("--only", default=None, help="comma-separated words: only the rows whose name contains one")
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  heads, seq, window = args.heads, args.seq, args.window
  data = kernel_inputs(heads, seq, window)
  inputs, d_out, shift, in_block_t = data.inputs, data.d_out, data.shift, data.in_block_t
  lookahead_keys, lse, delta, scale = data.lookahead_keys, data.lse, data.delta, data.scale
  split, key_major = CastleMosaicConfig(), CastleMosaicConfig(past_window="key_major")
  key_grads_in_sweep = CastleMosaicConfig(past_window_key_grads="key_major_sweep")
  common = dict(scale=scale, window=window, interpret=None)

  def forward(config, module):
    return jax.jit(lambda *a: module.forward(*a, in_block_t, shift, config=config, **common))

  def backward(config):
    return jax.jit(
      lambda *a: mosaic_backward.backward(*a, lookahead_keys, d_out, lse, delta, in_block_t, config=config, **common)
    )

  kernels = split_kernels(data, window)
  pairs = past_window_pairs(heads, seq, window)
  product = 2 * pairs * HEAD_DIM  # FLOPs of one [*, d] product over the past-window pairs
  candidates = [
    ("fwd key-major, all pairs", forward(key_major, mosaic_forward), None),
    ("fwd split (both kernels)", forward(split, mosaic_past_window), None),
    ("fwd key-major, window part", kernels["fwd_window"], None),
    ("fwd query-major, past window (128-key steps)", kernels["fwd_past"], 3 * product),
    ("fwd query-major, past window (64-key steps)", split_kernels(data, window, step_keys=64)["fwd_past"], 3 * product),
    ("bwd key-major, all pairs", backward(key_major), None),
    ("bwd split (all three kernels)", backward(split), None),
    ("bwd split, key side in the key-major sweep", backward(key_grads_in_sweep), None),
    ("bwd query-major dQ^C, past window", kernels["bwd_dq"], 5 * product),
    ("bwd key-side kernel (dK^C, dV^C, dD), past window", kernels["bwd_keys"], 6 * product),
  ]
  only = args.only.split(",") if args.only else None
  results = []
  for name, fn, flops in candidates:
    if only and not any(word in name for word in only):
      continue
    ms = median_ms(fn, [inputs], args.iters)
    results.append(dict(kernel=name, ms=ms, tflops=None if flops is None else flops / ms / 1e9))
    print(results[-1], flush=True)

  print(
    f"\n{heads} x {seq} x {HEAD_DIM}, window {window}, {jax.devices()[0].device_kind}, jax {jax.__version__}; "
    f"{pairs / (heads * seq * (seq + 1) / 2):.0%} of the causal pairs past the window"
  )
  print("| kernel | ms | TFLOP/s |\n| --- | --- | --- |")
  for row in results:
    tflops = "" if row["tflops"] is None else f"{row['tflops']:.0f}"
    print(f"| {row['kernel']} | {row['ms']:.2f} | {tflops} |")
  write_json(args.json, run_meta(heads=heads, seq=seq, window=window, iters=args.iters), rows=results)
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
