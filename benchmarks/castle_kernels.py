"""CASTLE Pallas kernels timed alone (forward kernel, backward kernel), per kernel config.

    python -m benchmarks.castle_kernels [--seq=16384] [--tokens=32768] \\
        [--configs='block_q=32,block_k=64;block_q=32,block_k=64,lookahead_operands=split'] \\
        [--without_atomics] [--flash_reference] [--json=out.json]

For tuning and for finding where the time goes: each config's forward kernel and
backward kernel run on [batch * heads, T, d] inputs without the wrapper's padding,
transposes, overflow check and normalization; the forward's time includes its two
small XLA inputs (the diagonal-score shift and the in-block scores R), the backward's
inputs are computed once outside the timing. `--without_atomics` replaces the kernels'
atomic adds with plain stores: the results are wrong, the timing shows what the
atomics cost. `--flash_reference` also times jax's own Pallas-Triton flash attention
(16 heads, same tokens) as the backend's ceiling. Prints a table last.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from castle_jax import command_line as cl
from pallas_kernels.castle import CastleKernelConfig, kernels, ops
from benchmarks.timing import error_text, median_ms, run_meta, write_json


def _store_instead_of_atomic_add(ref, idx, val):
  ref[idx] = val


def time_kernels(config, batch_heads: int, seq: int, head_dim: int, iters: int, without_atomics: bool) -> dict:
  scale = head_dim**-0.5
  sets = []
  for seed in range(2):
    keys = jax.random.split(jax.random.key(seed), 7)
    sets.append([jax.random.normal(k, (batch_heads, seq, head_dim), jnp.float32).astype(jnp.bfloat16) for k in keys])
  atomic_add = kernels.relaxed_atomic_add
  if without_atomics:
    kernels.relaxed_atomic_add = _store_instead_of_atomic_add
  try:
    forward = jax.jit(
      lambda q_u, k_u, v_u, q_c, k_c, v_c: kernels.forward(
        q_u,
        k_u,
        v_u,
        q_c,
        k_c,
        v_c,
        ops._diagonal_scores(q_c, k_c, scale),
        ops._in_block_scores(q_c, v_u, scale, config.block_q),
        scale=scale,
        window=None,
        config=config,
        interpret=False,
      )
    )
    backward = jax.jit(lambda *a: kernels.backward(*a, scale=scale, window=None, config=config, interpret=False))
    residuals = jax.jit(lambda *a: ops._forward(*a, scale, None, config, False))
    backward_args = []
    for q_u, k_u, v_u, q_c, k_c, v_c, d_out in sets:
      out, lse, keys = residuals(q_u, k_u, v_u, q_c, k_c, v_c)
      delta = jnp.sum(out * d_out.astype(jnp.float32), -1)
      backward_args.append(
        (
          q_u,
          k_u,
          v_u,
          q_c,
          k_c,
          v_c,
          keys,
          d_out,
          lse,
          delta,
          ops._in_block_scores(q_c, v_u, scale, config.bwd_block_q),
        )
      )
    return {
      "fwd_kernel_ms": median_ms(forward, [tuple(s[:6]) for s in sets], iters),
      "bwd_kernel_ms": median_ms(backward, backward_args, iters),
    }
  except Exception as e:  # one failing config must not lose the others
    return {"error": error_text(e)}
  finally:
    kernels.relaxed_atomic_add = atomic_add


def time_flash_reference(batch: int, seq: int, heads: int, head_dim: int, iters: int) -> dict:
  from jax.experimental.pallas.ops.gpu import attention

  def inputs(seed):
    return tuple(
      jax.random.normal(k, (batch, seq, heads, head_dim), jnp.float32).astype(jnp.bfloat16)
      for k in jax.random.split(jax.random.key(seed), 4)
    )

  sets = [inputs(0), inputs(1)]
  block_sizes = attention.BlockSizes(128, 64, 64, 64, 64, 64)
  fn = lambda q, k, v: attention.mha(q, k, v, None, sm_scale=head_dim**-0.5, causal=True, block_sizes=block_sizes)
  loss = lambda q, k, v, c: jnp.sum(fn(q, k, v).astype(jnp.float32) * c.astype(jnp.float32))
  try:
    return {
      "fwd_ms": median_ms(jax.jit(fn), [s[:3] for s in sets], iters),
      "fwd_bwd_ms": median_ms(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), sets, iters),
    }
  except Exception as e:
    return {"error": error_text(e)}


def _kernel_configs(text: str) -> list[tuple[str, CastleKernelConfig]]:
  return [(spec, CastleKernelConfig.from_string(spec)) for spec in text.split(";")]  # "" is the default config


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__)
  parser.add_argument("--seq", type=cl.positive_int, default=16384)
  parser.add_argument("--tokens", type=cl.positive_int, default=32768, help="batch * seq")
  parser.add_argument("--heads", type=cl.positive_int, default=9)
  parser.add_argument("--head_dim", type=cl.positive_int, default=128)
  parser.add_argument(
    "--configs",
    type=cl.parsed_by(_kernel_configs, "';'-separated CastleKernelConfig fields as key=value"),
    default="",
    help="';'-separated CastleKernelConfig fields as key=value, e.g. 'block_q=32,block_k=64;"
    "bwd_block_k=16' (default: one row with the default config)",
  )
  parser.add_argument("--without_atomics", action="store_true", help="also time each config with plain stores")
  parser.add_argument("--flash_reference", action="store_true")
  parser.add_argument("--iters", type=cl.positive_int, default=10)
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    parser.error("the kernels are timed compiled, on a GPU")
  if args.tokens % args.seq:
    parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq ({args.seq})")
  batch = args.tokens // args.seq

  rows = []
  for spec, config in args.configs:
    for without_atomics in (False, True) if args.without_atomics else (False,):
      row = {"config": spec, "without_atomics": without_atomics}
      row.update(time_kernels(config, batch * args.heads, args.seq, args.head_dim, args.iters, without_atomics))
      rows.append(row)
      print(row, file=sys.stderr, flush=True)
  if args.flash_reference:
    row = {"config": "jax pallas flash attention, 16 heads"}
    row.update(time_flash_reference(batch, args.seq, 16, args.head_dim, args.iters))
    rows.append(row)

  meta = run_meta(seq=args.seq, tokens=args.tokens, heads=args.heads, head_dim=args.head_dim)
  write_json(args.json, meta, rows=rows)
  print(f"\n{meta['device']} | jax {meta['jax']} | {batch} x {args.seq} x {args.heads} heads x {args.head_dim}")
  print(f"{'config':<40}{'atomics':>9}{'fwd ms':>10}{'bwd ms':>10}")
  for r in rows:
    fwd, bwd = r.get("fwd_kernel_ms", r.get("fwd_ms")), r.get("bwd_kernel_ms", r.get("fwd_bwd_ms"))
    label = "off" if r.get("without_atomics") else "on"
    if "error" in r:
      print(f"{r['config']:<40}{label:>9}  {r['error']}")
    else:
      extra = "  (flash: fwd, fwd+bwd)" if "fwd_ms" in r else ""
      print(f"{r['config']:<40}{label:>9}{fwd:>10.2f}{bwd:>10.2f}{extra}")
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
