"""Power attention: every implementation of the op next to standard attention and the paper
authors' kernels, in one run.

    python -m benchmarks.power_attention [--seq_lens=4096,16384,65536] [--tokens=65536] \
        [--impls=xla,triton,cudnn,authors] [--chunk_sizes=1024] [--json=out.json]
    python -m benchmarks.power_attention --smoke   # tiny shapes, any device (CI)

For each sequence length T the batch is tokens // T (the power-attention paper's
shape by default: 12 heads, head_dim 64, p = 2, per-head gating, bf16). Times the
forward and forward+backward (gradients of q, k, v and the log-gates) of each
implementation, median of --iters runs after warm-up over two input sets. `--impls` defaults
to the op's implementations (`castle_jax.ops.power.IMPLEMENTATIONS`, but "reference"), the
cuDNN baseline (on a GPU; "xla_mha" elsewhere) and the authors' kernels (where installed):
  triton  : ours, `power_attention(implementation="triton")` (fused kernels);
  xla     : ours, the chunked XLA form (`implementation="xla"`);
  reference: ours, the attention form from the definition;
  cudnn   : `jax.nn.dot_product_attention(implementation="cudnn")`, causal, same heads/dims
            (xla_mha: the same with implementation="xla");
  authors : PyPI `retention` 1.0.7 (`retention.triton.power_retention`, PyTorch + Triton),
            installed only where the benchmark runs; TRITON_NO_AUTOTUNE=1 unless
            --authors_autotune, so its kernels use their default configs (warm-up calls
            are not timed either way).
Chunked rows run once per chunk size in --chunk_sizes (a size >= T is the attention form).

Model FLOPs (one convention for every row, so TFLOP/s compare):
  power forward per token and head = 2 D d_v (update state) + 2 D d_v (query state)
    + 2 (c + 1) d (intra-chunk q.k and w.v over the causal pairs), D = C(d + 1, 2)
    (spow, the smallest exact expansion), c = min(chunk, T);
  standard attention forward = 4 d (T + 1) / 2 per token and head (causal);
  backward = 2.5 x forward for both.
Ratios are against cudnn and the authors' best chunk size at that T, measured in the same
run. Prints a table last and optionally writes JSON.
"""

from __future__ import annotations

import json
import math
import os
import sys

import jax
import jax.numpy as jnp

from castle_jax import command_line as cl
from castle_jax.ops.attention import causal_attention
from castle_jax.ops.power import IMPLEMENTATIONS, KERNEL_CONFIGS, power_attention
from pallas_kernels.power import default_triton_config, triton, triton_discumsum, triton_kernels
from benchmarks import timing


def power_forward_flops(batch: int, seq: int, heads: int, head_dim: int, chunk: int) -> float:
  chunk = min(chunk, seq)
  expanded = math.comb(head_dim + 1, 2)
  per_token = 4 * expanded * head_dim + 2 * (chunk + 1) * head_dim
  if chunk >= seq:  # the attention form: no state at all
    per_token = 2 * (seq + 1) * head_dim
  return float(batch * seq * heads * per_token)


def standard_forward_flops(batch: int, seq: int, heads: int, head_dim: int) -> float:
  return float(batch * heads * 2 * head_dim * seq * (seq + 1))


def _jax_inputs(batch, seq, heads, head_dim, dtype, gated: bool):
  args_sets = []
  for seed in range(2):
    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (batch, seq, heads, head_dim)
    q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys[:4])
    inputs = (q, k, v)
    if gated:
      inputs += (jax.nn.log_sigmoid(6.9 + jax.random.normal(keys[4], (batch, seq, heads), jnp.float32)),)
    args_sets.append(inputs + (cotangent,))
  return args_sets


def measure_jax(name: str, fn, batch, seq, heads, head_dim, dtype, iters, gated: bool) -> dict:
  """fwd and fwd+bwd of fn(q, k, v[, log_g]) -> [B, T, H, d]."""
  args_sets = _jax_inputs(batch, seq, heads, head_dim, dtype, gated)
  num_inputs = 4 if gated else 3
  row = {"impl": name, "batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim}
  row.update(timing.time_forward_and_gradients(fn, num_inputs, args_sets, iters))
  return row


def measure_authors(batch, seq, heads, head_dim, chunk, iters) -> dict:
  """The authors' kernels (PyPI `retention`), bf16, p = 2, gating, fwd and fwd+bwd."""
  row = {
    "impl": f"authors[c={chunk}]",
    "batch": batch,
    "seq": seq,
    "heads": heads,
    "head_dim": head_dim,
    "chunk": chunk,
  }
  try:
    import torch
    import torch.nn.functional as F
    from retention.triton import power_retention

    generator = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=generator)
    q, k, v = (randn(batch, seq, heads, head_dim).to(torch.bfloat16).requires_grad_() for _ in range(3))
    log_g = F.logsigmoid(6.9 + randn(batch, seq, heads)).requires_grad_()
    cotangent = randn(batch, seq, heads, head_dim).to(torch.bfloat16)
    chunk_size = None if chunk >= seq else chunk

    def forward():
      with torch.no_grad():
        return power_retention(q, k, v, log_g, deg=2, chunk_size=chunk_size)

    def forward_backward():
      out = power_retention(q, k, v, log_g, deg=2, chunk_size=chunk_size)
      torch.autograd.grad(out, (q, k, v, log_g), cotangent)

    row["fwd_ms"] = timing.torch_median_ms(forward, iters)
    row["fwd_bwd_ms"] = timing.torch_median_ms(forward_backward, iters)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
  except Exception as e:  # a missing or failing peer must not lose the other rows
    row["error"] = timing.error_text(e)
  return row


def kernel_breakdown(batch, seq, heads, head_dim, chunk, dtype, iters, config=None) -> list[dict]:
  """Each Pallas kernel timed alone on the shapes one call uses.

  FLOPs count the useful tensor-core products (D = the kernels' tspow dimension, not
  spow's; the selection products that build phi are not counted): update state 2 D d_v per
  token; query state + attention 2 D d_v + 2 (c + 1) d; state gradient 2 D d_v for queries
  (the cotangent product) and 4 D d_v for keys (also phi(k) S); attention backward
  5 (c + 1) d (q.k twice, dN.v twice, and three products for dq, dk, dv, halved by
  causality). The discumsums are memory-bound: GB/s instead.
  """
  config = config or default_triton_config()
  bh, tokens = batch * heads, batch * seq * heads
  dim = triton_kernels.expanded_dim(head_dim)
  n = seq // chunk
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (bh, seq, head_dim), jnp.float32).astype(dtype)
  w = jax.random.normal(keys[1], (bh, seq, head_dim), jnp.float32).astype(dtype)
  g = jnp.cumsum(jax.nn.log_sigmoid(6.9 + jax.random.normal(keys[2], (bh, n, chunk))), -1).reshape(bh, seq)
  r = jnp.exp(g)
  state = jax.random.normal(keys[3], (bh, n, dim, head_dim), jnp.float32).astype(dtype)
  normalizer = jnp.abs(jax.random.normal(keys[4], (bh, n, dim), jnp.float32))
  opts = dict(chunk=chunk, config=config, interpret=False)
  mha = dict(heads=heads, kv_heads=heads)
  cases = [
    ("update_state", lambda: triton.update_state(x, w, r, **opts), 2 * dim * head_dim * tokens),
    (
      "query_state_attention",
      lambda: triton.in_chunk_attention_forward(x, x, w, g, state, normalizer, **mha, **opts),
      (2 * dim * head_dim + 2 * (chunk + 1) * head_dim) * tokens,
    ),
    (
      "state_gradient(queries)",
      lambda: triton.state_gradient(x, w, r, state, normalizer, **mha, **opts),
      2 * dim * head_dim * tokens,
    ),
    (
      "state_gradient(keys)",
      lambda: triton.state_gradient(x, w, r, state, normalizer, **mha, with_product=True, **opts),
      4 * dim * head_dim * tokens,
    ),
    (
      "attention_backward",
      lambda: triton.in_chunk_attention_backward(x, x, w, g, w, r, **mha, **opts),
      5 * (chunk + 1) * head_dim * tokens,
    ),
  ]
  rows = []
  for name, fn, flops in cases:
    compiled = jax.jit(fn)
    ms = timing.median_ms(lambda *_: compiled(), [()], iters)
    rows.append({"kernel": name, "batch": batch, "seq": seq, "chunk": chunk, "ms": ms, "tflops": flops / ms / 1e9})
  states = jax.random.normal(keys[5], (bh, n, dim, head_dim), jnp.float32)
  totals = g[:, chunk - 1 :: chunk]
  size = jnp.dtype(dtype).itemsize
  scans = [
    # Reads the own states, writes the entering states.
    (
      "discumsum",
      lambda: triton_discumsum.discumsum(states, totals, states[:, 0], entering_dtype=dtype, interpret=False),
      states.size * (4 + size),
    ),
    # Reads the direct gradients and the entering states, writes the own states' gradients.
    (
      "reverse_discumsum",
      lambda: triton_discumsum.reverse_discumsum(states, totals, state, states[:, 0], interpret=False),
      states.size * (4 + size + 4),
    ),
  ]
  for name, fn, moved in scans:
    compiled = jax.jit(fn)
    ms = timing.median_ms(lambda *_: compiled(), [()], iters)
    rows.append({"kernel": name, "batch": batch, "seq": seq, "chunk": chunk, "ms": ms, "gb_per_s": moved / ms / 1e6})
  return rows


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__)
  parser.add_argument("--seq_lens", type=cl.positive_int_list, default="4096,16384,65536")
  parser.add_argument("--tokens", type=cl.positive_int, default=65536, help="batch * seq for every length")
  parser.add_argument("--heads", type=cl.positive_int, default=12)
  parser.add_argument("--head_dim", type=cl.positive_int, default=64)
  parser.add_argument(
    "--impls",
    type=cl.choice_list((*IMPLEMENTATIONS, "cudnn", "xla_mha", "authors")),
    default=None,
    help="comma list of: reference, xla, triton (the op's), cudnn, xla_mha (standard attention), authors; "
    "default: the op's but reference, the baseline and authors",
  )
  parser.add_argument(
    "--chunk_sizes", type=cl.positive_int_list, default="1024", help="chunk sizes of our chunked rows"
  )
  parser.add_argument(
    "--authors_chunk_sizes", type=cl.positive_int_list, default="1024", help="chunk sizes of the authors' rows"
  )
  parser.add_argument(
    "--authors_autotune", action="store_true", help="let the authors' kernels autotune (minutes on the first call)"
  )
  parser.add_argument(
    "--kernel_configs",
    type=cl.parsed_by(
      lambda text: timing.kernel_config_specs(text, KERNEL_CONFIGS), "';'-separated 'impl:key=value,...'"
    ),
    default="",
    help="';'-separated 'impl:key=value,...' kernel configs, e.g. 'triton:block_t=32,num_warps=8;triton:row_group=2', "
    "each timed as its own row of that implementation (default: its default config)",
  )
  parser.add_argument(
    "--breakdown_seq_lens",
    type=cl.optional_positive_int_list,
    default="",
    help="comma list of lengths at which to also time each Pallas kernel alone (at the first chunk size), "
    "once per triton kernel config",
  )
  parser.add_argument("--no_gating", action="store_true")
  parser.add_argument("--iters", type=cl.positive_int, default=10)
  parser.add_argument("--dtype", choices=cl.DTYPES, default="bfloat16")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, one timed call: checks the harness runs")
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  if args.smoke:
    timing.smoke_mode()
    args.seq_lens, args.tokens, args.heads, args.head_dim, args.iters, args.chunk_sizes = [128], 128, 2, 16, 1, [64]
  on_gpu = jax.default_backend() == "gpu"
  baseline = "cudnn" if on_gpu else "xla_mha"
  impls = args.impls or [
    *timing.implementations_to_time(IMPLEMENTATIONS).split(","),
    baseline,
    *(["authors"] if on_gpu else []),
  ]
  if not args.authors_autotune:
    os.environ.setdefault("TRITON_NO_AUTOTUNE", "1")

  dtype = jnp.dtype(args.dtype)
  gated = not args.no_gating
  chunks = args.chunk_sizes
  authors_chunks = args.authors_chunk_sizes
  for seq in args.seq_lens:
    if args.tokens % seq:
      parser.error(f"--tokens ({args.tokens}) must be a multiple of every sequence length ({seq})")

  rows, printed = [], 0
  for seq in args.seq_lens:
    batch = args.tokens // seq
    shape = (batch, seq, args.heads, args.head_dim)
    for impl in impls:
      if impl in ("cudnn", "xla_mha"):
        row = measure_jax(
          impl,
          lambda q, k, v, impl=impl: causal_attention(q, k, v, implementation="cudnn" if impl == "cudnn" else "xla"),
          *shape,
          dtype,
          args.iters,
          gated=False,
        )
        if "error" not in row:
          row["fwd_flops"] = standard_forward_flops(*shape)
        rows.append(row)
      elif impl == "authors":
        for chunk in authors_chunks:
          row = measure_authors(*shape, chunk, args.iters)
          if "error" not in row:
            row["fwd_flops"] = power_forward_flops(*shape, chunk)
          rows.append(row)
      else:
        configs = args.kernel_configs.get(impl, [("", None)])
        for chunk in chunks:
          for spec, config in configs:
            fn = lambda q, k, v, log_g=None, chunk=chunk, impl=impl, config=config: power_attention(
              q, k, v, log_g, p=2, chunk_size=chunk, implementation=impl, kernel_config=config
            )
            row = measure_jax(f"{impl}[c={chunk}{';' + spec if spec else ''}]", fn, *shape, dtype, args.iters, gated)
            row["chunk"] = chunk
            if impl == "triton":
              parts = triton.parts_on_mosaic(
                config or default_triton_config(),
                head_dim=args.head_dim,
                value_dim=args.head_dim,
                dtype=dtype,
                chunk=min(chunk, seq),
              )
              row["mosaic_parts"] = ",".join(parts) or "none"
            if "error" not in row:
              row["fwd_flops"] = power_forward_flops(*shape, chunk)
            rows.append(row)
      for row in rows[printed:]:
        print(json.dumps(row), file=sys.stderr, flush=True)
      printed = len(rows)

  breakdown = []
  if "triton" in impls:
    for seq in args.breakdown_seq_lens:
      for spec, config in args.kernel_configs.get("triton", [("", None)]):
        kernels = kernel_breakdown(
          args.tokens // seq, seq, args.heads, args.head_dim, min(chunks[0], seq), dtype, args.iters, config
        )
        breakdown += [row | {"config": spec or "default"} for row in kernels]
        for row in breakdown[-len(kernels) :]:
          print(json.dumps(row), file=sys.stderr, flush=True)

  for row in rows:
    if "error" in row:
      continue
    row["fwd_tflops"] = row["fwd_flops"] / row["fwd_ms"] / 1e9
    row["fwd_bwd_tflops"] = 3.5 * row["fwd_flops"] / row["fwd_bwd_ms"] / 1e9
    same_seq = [r for r in rows if r["seq"] == row["seq"] and "error" not in r]
    base = next((r for r in same_seq if r["impl"] in ("cudnn", "xla_mha")), None)
    authors = min((r for r in same_seq if r["impl"].startswith("authors")), key=lambda r: r["fwd_bwd_ms"], default=None)
    if base:
      row["base_over_this_fwd_bwd"] = base["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    if authors:
      row["authors_best_over_this_fwd_bwd"] = authors["fwd_bwd_ms"] / row["fwd_bwd_ms"]

  meta = timing.run_meta(
    dtype=args.dtype, p=2, gating=gated, tokens=args.tokens, authors_autotune=args.authors_autotune
  )
  timing.write_json(args.json, meta, rows=rows, kernels=breakdown)

  print(
    f"\n{meta['device']} | jax {meta['jax']} | {args.dtype} | p=2 | gating {gated} | {args.tokens} tokens"
    f" | speed-ups: >1 means this row is faster"
  )
  timing.print_table(
    rows,
    [
      ("impl", "impl", ""),
      ("batch", "batch", "d"),
      ("T", "seq", "d"),
      *timing.TIME_COLUMNS,
      (f"{baseline} / this", "base_over_this_fwd_bwd", ".2f"),
      ("authors' best / this", "authors_best_over_this_fwd_bwd", ".2f"),
      timing.PEAK_COLUMN,
      ("on Mosaic GPU", "mosaic_parts", ""),
    ],
  )
  if breakdown:
    print(f"\n{'kernel (alone)':<24}{'B x T':>13}{'chunk':>7}{'ms':>9}{'TF/s or GB/s':>14}  config")
    for r in breakdown:
      rate = f"{r['tflops']:.1f} TF/s" if "tflops" in r else f"{r['gb_per_s']:.0f} GB/s"
      print(f"{r['kernel']:<24}{r['batch']:>5} x {r['seq']:<6}{r['chunk']:>7}{r['ms']:>9.3f}{rate:>14}  {r['config']}")
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
