"""One-token decoding step of power attention (recurrent state) next to a KV-cache step.

    python -m benchmarks.power_decode [--batch=64] [--lengths=4096,16384,65536] [--heads=12] \
        [--head_dim=64] [--json=out.json]

Times `castle_jax.ops.power.decode_step` (p = 2, gating, spow state: output from the state,
then the state update; cache donated) against the mha layer's cached attention step with
the cache filled to each length. The power step reads a [D, d_v] state per head whatever
the length, so its time should not move with the length; the KV-cache step reads the
whole cache. Reports step time and cache memory; median of --iters steps after warm-up.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.castle_decode import _filled, mha_row
from castle_jax import command_line as cl
from castle_jax.ops.power import decode_step, init_cache
from benchmarks.timing import median_step_ms, run_meta, tree_bytes, write_json


def power_row(batch, length, heads, head_dim, dtype, iters):
  keys = jax.random.split(jax.random.key(2), 6)
  cache = init_cache(batch, heads, head_dim, p=2)
  # A state of `length` tokens has the same size and cost as any other: fill it with numbers.
  cache = type(cache)(
    _filled(cache.state.shape, jnp.float32, keys[0]),
    jnp.abs(_filled(cache.normalizer.shape, jnp.float32, keys[1])),
    jnp.asarray(length, jnp.int32),
  )
  token = tuple(_filled((batch, 1, heads, head_dim), dtype, k) for k in keys[2:5])
  token += (jax.nn.log_sigmoid(_filled((batch, 1, heads), jnp.float32, keys[5]) + 6.9),)

  def step(cache, q, k, v, log_g):
    return decode_step(cache, q, k, v, log_g, p=2)

  return {
    "impl": "power_p2_state",
    "heads": heads,
    "length": length,
    "step_ms": median_step_ms(jax.jit(step, donate_argnums=0), cache, token, iters),
    "cache_gib": tree_bytes(cache) / 2**30,
  }


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__)
  parser.add_argument("--batch", type=cl.positive_int, default=64)
  parser.add_argument(
    "--lengths", type=cl.positive_int_list, default="4096,16384,65536", help="tokens already in the cache"
  )
  parser.add_argument("--heads", type=cl.positive_int, default=12)
  parser.add_argument("--head_dim", type=cl.positive_int, default=64)
  parser.add_argument("--skip_mha", action="store_true", help="time only the power step")
  parser.add_argument("--iters", type=cl.positive_int, default=20)
  parser.add_argument("--dtype", choices=cl.DTYPES, default="bfloat16")
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)

  rows = []
  for length in args.lengths:
    if not args.skip_mha:
      row = mha_row(args.batch, length, args.heads, args.head_dim, dtype, args.iters)
      rows.append(dict(row, length=length))
    rows.append(power_row(args.batch, length, args.heads, args.head_dim, dtype, args.iters))
    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  meta = run_meta(batch=args.batch, head_dim=args.head_dim, heads=args.heads, dtype=args.dtype)
  write_json(args.json, meta, rows=rows)
  print(
    f"\n{meta['device']} | jax {meta['jax']} | batch {args.batch} | {args.heads} heads x {args.head_dim} | {args.dtype}"
  )
  print(f"{'impl':<18}{'length':>8}{'step ms':>10}{'cache GiB':>11}")
  for r in rows:
    print(f"{r['impl']:<18}{r['length']:>8}{r['step_ms']:>10.3f}{r['cache_gib']:>11.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
