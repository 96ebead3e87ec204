"""One-token decoding step: CASTLE's UQ-KV cache next to a standard KV cache, in one run.

    python -m benchmarks.castle_decode [--batch=64] [--length=16384] [--heads=9] \
        [--baseline_heads=16] [--head_dim=128] [--window=512] [--impls=xla,triton] \
        [--decode_configs='block_rows=64;block_rows=128,num_warps=8'] [--json=out.json]

Times `castle_jax.ops.castle.decode_step` (rank-1 update of the lookahead keys, then
the combining step; cache donated so it updates in place) for CASTLE and CASTLE-SWL,
as XLA ops and as the fused Pallas kernel (one row per --decode_configs entry of
CastleDecodeConfig fields as key=value, ';'-separated), against the mha layer's cached attention step (append k/v, attend over the cache),
with caches filled to `length` tokens. Reports the step time and the cache memory
(the paper's Table 30 compares the same two caches). Median of --iters steps after
warm-up; prints a table last and optionally writes JSON.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp

from castle_jax import command_line as cl
from castle_jax.ops.attention import KVCache
from castle_jax.ops.attention import causal_mask, masked_attention
from castle_jax.ops.castle import UQKVCache, decode_step
from pallas_kernels.castle import CastleDecodeConfig
from benchmarks.timing import median_step_ms, run_meta, tree_bytes, write_json


def _filled(shape, dtype, key):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def castle_row(batch, length, heads, head_dim, window, dtype, iters, implementation="xla", config=None):
  capacity = length + 4 + iters
  keys = jax.random.split(jax.random.key(0), 10)
  full = (batch, capacity, heads, head_dim)
  query_rows = capacity if window is None else min(window, capacity)
  cache = UQKVCache(
    lookahead_keys=_filled(full, dtype, keys[0]),
    lookahead_queries=_filled((batch, query_rows, heads, head_dim), dtype, keys[1]),
    causal_keys=_filled(full, dtype, keys[2]),
    causal_values=_filled(full, dtype, keys[3]),
    length=jnp.asarray(length, jnp.int32),
    window=window,
  )
  token = tuple(_filled((batch, 1, heads, head_dim), dtype, k) for k in keys[4:10])
  step = jax.jit(functools.partial(decode_step, implementation=implementation, kernel_config=config), donate_argnums=0)
  name = "castle" if window is None else f"castle_swl(W={window})"
  name += f" {implementation}" + (f" {_config_label(config)}" if config else "")
  return {
    "impl": name,
    "implementation": implementation,
    "config": config and dataclasses.asdict(config),
    "heads": heads,
    "step_ms": median_step_ms(step, cache, token, iters),
    "cache_gib": tree_bytes(cache) / 2**30,
  }


def _config_label(config):
  return f"{config.block_rows}/{config.splits or 0}/{config.num_warps}/{config.num_stages}"


def _parse_configs(text):
  """';'-separated CastleDecodeConfig fields as key=value ('' entries are the default)."""
  return [CastleDecodeConfig.from_string(entry) for entry in text.split(";")]


def mha_row(batch, length, heads, head_dim, dtype, iters):
  capacity = length + 4 + iters
  keys = jax.random.split(jax.random.key(1), 5)
  full = (batch, capacity, heads, head_dim)
  cache = KVCache(_filled(full, dtype, keys[0]), _filled(full, dtype, keys[1]), jnp.asarray(length, jnp.int32))
  token = tuple(_filled((batch, 1, heads, head_dim), dtype, k) for k in keys[2:5])

  def step(cache, q, k, v):
    positions = jnp.broadcast_to(cache.length, (batch, 1))
    cache = cache.append(k, v)
    return masked_attention(q, cache.keys, cache.values, causal_mask(positions, cache.key_positions())), cache

  return {
    "impl": "mha_kv_cache",
    "heads": heads,
    "step_ms": median_step_ms(jax.jit(step, donate_argnums=0), cache, token, iters),
    "cache_gib": tree_bytes(cache) / 2**30,
  }


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__)
  parser.add_argument("--batch", type=cl.positive_int, default=64)
  parser.add_argument("--length", type=cl.positive_int, default=16384, help="tokens already in the cache")
  parser.add_argument("--heads", type=cl.positive_int, default=9)
  parser.add_argument("--baseline_heads", type=cl.positive_int, default=16)
  parser.add_argument("--head_dim", type=cl.positive_int, default=128)
  parser.add_argument("--window", type=cl.nonnegative_int, default=512, help="CASTLE-SWL window (0: skip SWL)")
  parser.add_argument(
    "--impls",
    type=cl.choice_list(("xla", "triton")),
    default="xla,triton",
    help="CASTLE decoding steps to time: xla, triton",
  )
  parser.add_argument(
    "--decode_configs",
    type=cl.parsed_by(_parse_configs, "';'-separated CastleDecodeConfig fields as key=value"),
    default="",
    help="';'-separated Pallas kernel tilings, CastleDecodeConfig fields as key=value, e.g. "
    "'block_rows=64,splits=8;block_rows=128' (default: one row with the default)",
  )
  parser.add_argument("--iters", type=cl.positive_int, default=20)
  parser.add_argument("--dtype", choices=cl.DTYPES, default="bfloat16")
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)

  rows = [mha_row(args.batch, args.length, args.baseline_heads, args.head_dim, dtype, args.iters)]
  windows = [None] + ([args.window] if args.window else [])
  for window in windows:
    for implementation in args.impls:
      configs = args.decode_configs if implementation == "triton" else [None]
      for config in configs:
        rows.append(
          castle_row(
            args.batch, args.length, args.heads, args.head_dim, window, dtype, args.iters, implementation, config
          )
        )
  base = rows[0]
  for row in rows:
    row["step_ratio"] = row["step_ms"] / base["step_ms"]
    row["cache_ratio"] = row["cache_gib"] / base["cache_gib"]
  meta = run_meta(batch=args.batch, length=args.length, head_dim=args.head_dim, dtype=args.dtype)
  write_json(args.json, meta, rows=rows)
  print(
    f"\n{meta['device']} | jax {meta['jax']} | batch {args.batch} | cache length {args.length} | "
    f"head_dim {args.head_dim} | {args.dtype}"
  )
  print(f"{'impl':<36}{'heads':>6}{'step ms':>10}{'x mha':>8}{'cache GiB':>11}{'x mha':>8}")
  for r in rows:
    print(
      f"{r['impl']:<36}{r['heads']:>6}{r['step_ms']:>10.3f}{r['step_ratio']:>8.2f}{r['cache_gib']:>11.2f}"
      f"{r['cache_ratio']:>8.2f}"
    )
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
