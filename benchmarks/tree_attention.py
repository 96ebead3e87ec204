"""Hybrid tree attention: every implementation of the op against dense masked attention over
[cache ; tree], and single-token decoding steps next to cuDNN, at the LongSpec target's heads.

    python -m benchmarks.tree_attention --lengths=4096,16384,32768 --nodes=69 [--impls=xla,triton] \
        --kernel_configs="triton:block_keys=64;triton:block_rows=64,block_keys=64" --out=tree_attention.json
    python -m benchmarks.tree_attention --rows=tree --impls=mosaic --profile   # device time by kernel
    python -m benchmarks.tree_attention --smoke   # tiny shapes, any device (CI)

Each row times one compiled function that runs `--repeats` passes over `--layers`
calls, one cache per layer (separate arrays, so nothing is sliced or copied, and, as in
a model's forward, no layer finds its cache in L2), each layer's query taken from the
previous layer's output (so that nothing is hoisted out of the loop); the median time
per call is reported (the dispatch of the whole function spread over them). Rows:
  - dense: `masked_attention` (the model's masked decoding op, float32 softmax) over the
    concatenation [cache capacity ; tree] with the combined mask: attention without the
    hybrid split;
  - each of `--impls` (default: the op's implementations, `castle_jax.ops.tree_attention.IMPLEMENTATIONS`,
    but "reference"): "xla", `tree_attention(implementation="xla")`, cache part over the
    capacity (masked by the length) + tree part + LSE merge; "triton" and "mosaic", the
    Pallas kernels (and each --kernel_configs tiling);
  - decode rows, n = 1 (a single-token step over the same cache): the model's previous
    masked step, the op's cache part by each of `--impls`, and cuDNN
    (`jax.nn.dot_product_attention` with the key length) where it runs.
The memory-bound time is the filled cache's K and V bytes over the bandwidth of a
plain read of the same caches, measured in the same run (`read` row). Writes JSON to
--out and prints a table last.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax import command_line as cl
from castle_jax.eval.cli import format_table
from castle_jax.ops.attention.reference import masked_attention
from castle_jax.ops.tree_attention import (
  IMPLEMENTATIONS,
  KERNEL_CONFIGS,
  cache_attention,
  tree_attention,
  tree_mask_from_parents,
)
from benchmarks import synthetic_step
from benchmarks.timing import error_text, implementations_to_time, kernel_configs, median_ms, smoke_mode


ROWS = ("read", "dense", "tree", "decode")
PROFILED_RUNS = 2
PROFILED_KERNELS = 8  # recorded per row, largest first


def parse_args(argv):
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", type=cl.positive_int_list, default="4096,16384,32768", help="filled cache slots")
  parser.add_argument("--headroom", type=cl.nonnegative_int, default=1024, help="capacity = length + headroom")
  parser.add_argument(
    "--nodes", type=cl.positive_int, default=69, help="tree nodes (LongSpec's [4,16,16,16,16] + root: 69)"
  )
  parser.add_argument("--heads", type=cl.positive_int, default=8)
  parser.add_argument("--kv_heads", type=cl.positive_int, default=4)
  parser.add_argument("--head_dim", type=cl.positive_int, default=64)
  parser.add_argument("--batch", type=cl.positive_int, default=1)
  parser.add_argument("--layers", type=cl.positive_int, default=16, help="caches (one per layer) of one pass")
  parser.add_argument("--repeats", type=cl.positive_int, default=8, help="passes over the layers per timed call")
  parser.add_argument("--dtype", choices=cl.DTYPES, default="bfloat16")
  parser.add_argument("--iters", type=cl.positive_int, default=20)
  parser.add_argument(
    "--impls",
    type=cl.choice_list(IMPLEMENTATIONS),
    default=implementations_to_time(IMPLEMENTATIONS),
    help="the op's implementations",
  )
  parser.add_argument(
    "--kernel_configs",
    type=cl.parsed_by(lambda text: kernel_configs(text, KERNEL_CONFIGS), "';'-separated 'impl:key=value,...'"),
    default="",
    help="extra tilings, ';'-separated 'triton:key=value,...' or 'mosaic:key=value,...' (a row each)",
  )
  parser.add_argument(
    "--rows",
    type=cl.choice_list(ROWS),
    default=",".join(ROWS),
    help="which rows to time: the K/V read, dense masked attention, the implementations on the tree, "
    "single-token steps (the dense rows take most of a run's time at long caches)",
  )
  parser.add_argument(
    "--profile",
    action="store_true",
    help=f"trace {PROFILED_RUNS} more runs of each tree row and record its device time per call by kernel "
    "(row keys kernel_us, device_us, kernels): the kernel itself against the XLA work around it",
  )
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, one timed call: checks the harness runs")
  parser.add_argument("--out", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  if args.heads % args.kv_heads:
    parser.error(f"--heads={args.heads} must be a multiple of --kv_heads={args.kv_heads}")
  if args.smoke:
    smoke_mode()
    args.lengths, args.headroom, args.nodes, args.layers, args.repeats, args.iters = [64], 16, 5, 2, 1, 1
  return args


def tree_parents(nodes: int, seed: int = 0) -> np.ndarray:
  """A LongSpec-like tree: root 0, then levels of up to 16 nodes under random parents."""
  rng = np.random.default_rng(seed)
  parents, level = [-1], [0]
  while len(parents) < nodes:
    width = min(16 if len(parents) > 1 else 4, nodes - len(parents))
    start = len(parents)
    parents += [int(rng.choice(level)) for _ in range(width)]
    level = list(range(start, start + width))
  return np.array(parents, np.int32)


def _chain(attend, repeats: int):
  """A jitted fn(q, per_layer) running `attend(q, *per_layer[i])` over the layers `repeats`
  times, each call's q the previous call's output."""

  def run(q, per_layer):
    def one_pass(_, q):
      for inputs in per_layer:
        q = attend(q, *inputs).astype(q.dtype)
      return q

    return jax.lax.fori_loop(0, repeats, one_pass, q)

  return jax.jit(run)


def _kernel_times(fn, fn_args, *, calls: int) -> dict:
  """Device time per call of the op (one of `calls` in a run of `fn`): "kernel_us" by kernel,
  the PROFILED_KERNELS largest; "device_us", every kernel summed; "kernels", the launches."""
  times = synthetic_step.kernel_times_per_call(
    lambda: jax.block_until_ready(fn(*fn_args)), PROFILED_RUNS, PROFILED_KERNELS
  )
  if not times:
    return {}
  return {
    "kernel_us": {name: 1e3 * ms / calls for name, ms in times["ops_ms"].items()},
    "device_us": 1e3 * times["device_ms"] / calls,
    "kernels": times["kernels"] / calls,
  }


def main(argv) -> int:
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  lengths = args.lengths
  impls = args.impls
  configs = args.kernel_configs
  b, n, h, kv, d, layers = args.batch, args.nodes, args.heads, args.kv_heads, args.head_dim, args.layers
  mask = tree_mask_from_parents(jnp.asarray(tree_parents(n)))
  records = []

  def record(kind, length, nodes, name, fn, fn_args, bytes_read):
    try:
      ms = median_ms(fn, [fn_args], args.iters) / (layers * args.repeats)
      row = {
        "kind": kind,
        "length": length,
        "nodes": nodes,
        "name": name,
        "ms_per_layer": ms,
        "gb_per_s": bytes_read / ms / 1e6,
      }
      if args.profile and kind == "tree":
        row.update(_kernel_times(fn, fn_args, calls=layers * args.repeats))
    except Exception as e:  # one failing row must not lose the others
      row = {"kind": kind, "length": length, "nodes": nodes, "name": name, "error": error_text(e)}
    records.append(row)
    print(json.dumps(row), flush=True)

  # (row name, implementation, kernel config) of each tree row: the defaults, then the extra tilings.
  tree_rows = []
  if "tree" in args.rows:
    tree_rows = [(impl, impl, None) for impl in impls]
    tree_rows += [(f"{impl} {config}", impl, config) for impl in impls for config in configs.get(impl, ())]
  for length in lengths:
    capacity = length + args.headroom
    keys = jax.random.split(jax.random.key(length), 6)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
    per_layer = lambda key, shape: [normal(k, shape) for k in jax.random.split(key, layers)]
    cache_k = per_layer(keys[0], (b, capacity, kv, d))
    cache_v = per_layer(keys[1], (b, capacity, kv, d))
    tree_k = per_layer(keys[2], (b, n, kv, d))
    tree_v = per_layer(keys[3], (b, n, kv, d))
    q_tree = normal(keys[4], (b, n, h, d))
    q_one = normal(keys[5], (b, 1, h, d))
    filled = jnp.int32(length)
    cache_bytes = length * kv * d * 2 * dtype.itemsize * b
    chain = functools.partial(_chain, repeats=args.repeats)

    # A read of each layer's filled K and V, scaled by the carry so that it stays in the loop.
    read = lambda x, k, v: (
      x
      + jnp.sum(k[:, :length] * x[0, 0, 0, 0], dtype=jnp.float32)
      + jnp.sum(v[:, :length] * x[0, 0, 0, 0], dtype=jnp.float32)
    )
    if "read" in args.rows:
      record("read", length, 0, "read K,V (bandwidth)", chain(read), (q_one, list(zip(cache_k, cache_v))), cache_bytes)

    slots = jnp.arange(capacity + n)
    dense_mask = jnp.concatenate([jnp.broadcast_to(slots[None, :capacity] < length, (n, capacity)), mask], axis=1)

    def dense(q, ck, cv, tk, tv):
      keys_all = jnp.concatenate([ck, tk], axis=1)
      values_all = jnp.concatenate([cv, tv], axis=1)
      return masked_attention(q, keys_all, values_all, jnp.broadcast_to(dense_mask, (b, n, capacity + n)))

    tree_inputs = (q_tree, list(zip(cache_k, cache_v, tree_k, tree_v)))
    if "dense" in args.rows:
      record("tree", length, n, "dense masked [cache ; tree]", chain(dense), tree_inputs, cache_bytes)
    for name, impl, config in tree_rows:
      attend = functools.partial(
        lambda q, ck, cv, tk, tv, impl, config: tree_attention(
          q, ck, cv, filled, tk, tv, mask, implementation=impl, kernel_config=config
        ),
        impl=impl,
        config=config,
      )
      record("tree", length, n, name, chain(attend), tree_inputs, cache_bytes)

    if "decode" not in args.rows:
      continue
    one_inputs = (q_one, list(zip(cache_k, cache_v)))
    step_mask = jnp.broadcast_to(jnp.arange(capacity)[None, None, :] < length, (b, 1, capacity))
    record(
      "decode",
      length,
      1,
      "masked over capacity (previous step)",
      chain(lambda q, ck, cv: masked_attention(q, ck, cv, step_mask)),
      one_inputs,
      cache_bytes,
    )
    for name, impl in ((f"{impl} cache part", impl) for impl in impls):
      attend = functools.partial(
        lambda q, ck, cv, impl: cache_attention(q, ck, cv, filled, implementation=impl)[0], impl=impl
      )
      record("decode", length, 1, name, chain(attend), one_inputs, cache_bytes)
    kv_lengths = jnp.full((b,), length, jnp.int32)
    cudnn = lambda q, ck, cv: jax.nn.dot_product_attention(
      q, ck, cv, key_value_seq_lengths=kv_lengths, implementation="cudnn"
    )
    record("decode", length, 1, "cuDNN (key lengths)", chain(cudnn), one_inputs, cache_bytes)

  rows = []
  for row in records:
    base = {(r["kind"], r["name"]): r for r in records if r["length"] == row["length"] and "error" not in r}
    read = base.get(("read", "read K,V (bandwidth)"))
    dense = base.get(("tree", "dense masked [cache ; tree]"))
    one = base.get(("decode", "triton cache part"))
    if "error" in row:
      rows.append([row["length"], row["nodes"], row["name"], "error", "", "", "", row["error"][:60]])
      continue
    ms = row["ms_per_layer"]
    rows.append(
      [
        row["length"],
        row["nodes"],
        row["name"],
        f"{1e3 * ms:.1f}",
        f"{row['gb_per_s']:.0f}",
        f"{dense['ms_per_layer'] / ms:.2f}x" if dense and row["kind"] == "tree" else "",
        f"{ms / one['ms_per_layer']:.2f}" if one else "",
        f"{ms / read['ms_per_layer']:.2f}" if read else "",
      ]
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
        {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(args), "rows": records},
        f,
        indent=1,
        default=str,  # kernel configs as their repr
      )
  print(
    f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.dtype}, batch {b}, {h} query / {kv} KV "
    f"heads of {d}, {args.repeats} x {layers} calls per timing, medians per call"
  )
  print(
    format_table(
      ["cache", "n", "implementation", "us/call", "GB/s (cache K,V)", "speed-up vs dense", "/ triton n=1", "/ read"],
      rows,
    )
  )
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
