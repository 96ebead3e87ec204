"""A/B of the sigmoid inside the Mosaic GPU CASTLE-SWL kernels, in one process (H100).

    python -m benchmarks.castle_mosaic_sigmoid_ab [--variants=divide,rsqrt,tanh,poly] \
        [--kernels=fwd_window,fwd_past,bwd_dq,bwd_keys] [--heads=18] [--seq=16384] [--window=512]

Every (query, key) pair takes a SiLU (and in the backward its derivative), so the
sigmoid's instructions are a share of the elementwise work between the products.
Variants (each replaces `mosaic_math.sigmoid`, from which SiLU and SiLU' are built):
- divide: 1 / (1 + e^-x), an IEEE division in Mosaic GPU;
- rsqrt:  rsqrt(1 + e^-x)^2, two MUFU instructions (ex2, rsqrt), the kernels' choice;
- tanh:   0.5 + 0.5 tanh(x / 2), one MUFU instruction (tanh.approx.f32, ~2^-11
          relative error): shows how much the MUFU unit limits a kernel;
- poly:   rsqrt(1 + 2^y)^2 with 2^y on the FMA units (degree-4 polynomial, 7.3e-6
          relative error; Cody-Waite split through the float32 exponent bits): one MUFU
          instruction, ten more FMA/ALU ones.
Prints each kernel's time per variant and its outputs' largest difference from
"divide", relative to the largest output.
"""

from __future__ import annotations

import sys
import time

import jax
from jax import lax
import jax.numpy as jnp


from benchmarks.castle_mosaic_swl_kernels import HEAD_DIM, kernel_inputs, past_window_pairs, split_kernels  # noqa: E402
from castle_jax import command_line as cl  # noqa: E402
from pallas_kernels.castle import mosaic_math  # noqa: E402
from benchmarks.timing import median_ms  # noqa: E402

_ROUND_TO_INTEGER = 12582912.0  # 1.5 * 2^23: adding it rounds a float32 below 2^22 to an integer
_EXP2_FRACTION = (
  1.0000001192092896,
  0.6931210160255432,
  0.2402210682630539,
  0.055922120809555054,
  0.009676046669483185,
)  # 2^f on [-1/2, 1/2], Chebyshev fit, degree 4


def exp2_on_fma_units(y):
  """2^y for float32 y (clamped to [-125, 125]) without the MUFU unit."""
  y = jnp.minimum(jnp.maximum(y, -125.0), 125.0)
  # The barrier keeps compilers from folding (y + c) - c into y.
  shifted = lax.optimization_barrier(y + _ROUND_TO_INTEGER)
  fraction = y - (shifted - _ROUND_TO_INTEGER)
  power = _EXP2_FRACTION[-1]
  for coefficient in _EXP2_FRACTION[-2::-1]:
    power = power * fraction + coefficient
  # The low mantissa bits of `shifted` hold round(y); shifted by 23 they are its exponent field.
  exponent = lax.shift_left(lax.bitcast_convert_type(shifted, jnp.int32), 23)
  return lax.bitcast_convert_type(lax.bitcast_convert_type(power, jnp.int32) + exponent, jnp.float32)


def _poly_sigmoid(x):
  root = lax.rsqrt(1.0 + exp2_on_fma_units(x * -1.4426950408889634))
  return root * root


VARIANTS = {
  "divide": lambda x: 1.0 / (1.0 + jnp.exp(-x)),
  "rsqrt": mosaic_math.sigmoid,
  "tanh": lambda x: 0.5 + 0.5 * jnp.tanh(0.5 * x),
  "poly": _poly_sigmoid,
}

# The kernels of `castle_mosaic_swl_kernels.split_kernels`.
KERNELS = ("fwd_window", "fwd_past", "bwd_dq", "bwd_keys")


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--variants", type=cl.choice_list(tuple(VARIANTS)), default="divide,rsqrt,tanh,poly")
  parser.add_argument("--kernels", type=cl.choice_list(KERNELS), default=",".join(KERNELS))
  parser.add_argument("--heads", type=cl.positive_int, default=18, help="batch x heads")
  parser.add_argument("--seq", type=cl.positive_int, default=16384)
  parser.add_argument("--window", type=cl.positive_int, default=512)
  parser.add_argument("--iters", type=cl.positive_int, default=5)
  args = parser.parse_args(argv)
  heads, seq, window = args.heads, args.seq, args.window
  t0 = time.time()
  data = kernel_inputs(heads, seq, window)
  print(f"inputs {time.time() - t0:.0f}s", flush=True)
  product = 2 * past_window_pairs(heads, seq, window) * HEAD_DIM
  flops = {"fwd_past": 3 * product, "bwd_dq": 5 * product, "bwd_keys": 6 * product}
  variants = args.variants
  table = []
  for name in args.kernels:
    outs = {}
    for variant in variants:
      mosaic_math.sigmoid = VARIANTS[variant]
      t0 = time.time()
      fn = split_kernels(data, window)[name]  # traced anew with this sigmoid
      outs[variant] = jax.block_until_ready(fn(*data.inputs))
      ms = median_ms(fn, [data.inputs], args.iters)
      rate = f"{flops[name] / ms / 1e9:.0f}" if name in flops else ""
      reference = outs[variants[0]]
      diff = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(outs[variant]))
      )
      table.append((name, variant, ms, rate, diff))
      print(
        f"{name} {variant}: {ms:.3f} ms {rate} TFLOP/s, differs from {variants[0]} by {diff:.1e} "
        f"(compile + run {time.time() - t0:.0f}s)",
        flush=True,
      )
  mosaic_math.sigmoid = VARIANTS["rsqrt"]
  print(f"\n{heads} x {seq} x {HEAD_DIM}, window {window}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
  print(f"| kernel | sigmoid | ms | TFLOP/s | max diff from {variants[0]} (rel.) |\n| --- | --- | --- | --- | --- |")
  for name, variant, ms, rate, diff in table:
    print(f"| {name} | {variant} | {ms:.3f} | {rate} | {diff:.1e} |")
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
