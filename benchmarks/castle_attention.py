"""CASTLE attention: every implementation of the op next to cuDNN attention, in one run.

    python -m benchmarks.castle_attention [--seq_lens=2048,8192,16384] [--tokens=32768] \
        [--impls=xla,triton,mosaic,cudnn] [--kernel_configs=triton:block_q=64;mosaic:] \
        [--window=512] [--json=out.json]
    python -m benchmarks.castle_attention --smoke   # tiny shapes, any device (CI)

For each sequence length T the batch is tokens // T (the CASTLE paper's XL attention
shape by default: 9 CASTLE heads, 16 baseline heads, head_dim 128, bf16). `--impls`
defaults to the op's implementations (`castle_jax.ops.castle.IMPLEMENTATIONS`, but the
O(T^3) "reference") and the standard-attention baseline ("cudnn" on a GPU, "xla_mha"
elsewhere); an implementation that cannot run here is a row saying why. Times the forward
and forward+backward (gradients of all inputs) of each with `jax.block_until_ready`,
median of --iters runs after warm-up, over two input sets in turn. Peak memory is the
compiled fwd+bwd program's own (temporaries plus arguments and outputs, from XLA's memory
analysis), so it is not disturbed by other buffers alive in the process.

Model FLOPs (the same convention for every row, so TFLOP/s compare):
  standard attention forward  = 4 d * causal_pairs per head (q.k and p.v);
  CASTLE forward = 2 d * (3 causal_pairs + 3 lookahead_pairs) per head (q^C.k^C, p.v^C,
    q^C.u over causal pairs; q^U.k^U, the lookahead-key update and q^C.v^U over the
    pairs inside the lookahead window), the blockwise algorithm's in-block term not counted;
  backward = 2.5 x forward for both.
Ratios are against the baseline measured in the same run. Prints a table last and
optionally writes JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Callable

import jax
import jax.numpy as jnp

from castle_jax import command_line as cl
from castle_jax.ops.attention import causal_attention
from castle_jax.ops.castle import castle_attention
from castle_jax.ops.castle import IMPLEMENTATIONS, KERNEL_CONFIGS
from benchmarks.timing import (
  PEAK_COLUMN,
  TIME_COLUMNS,
  error_text,
  implementations_to_time,
  kernel_configs,
  print_table,
  run_meta,
  smoke_mode,
  time_forward_and_gradients,
  torch_median_ms,
  write_json,
)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  heads: int
  num_inputs: int  # 6 for CASTLE, 3 for standard attention
  fn: Callable  # (*inputs) -> out
  castle: bool


def _castle_case(impl: str, heads: int, window, block_size: int, kernel_config=None, label: str = "") -> Case:
  def fn(*inputs):
    return castle_attention(
      *inputs, window=window, implementation=impl, block_size=block_size, kernel_config=kernel_config
    )

  return Case(f"castle_{impl}{label}", heads, 6, fn, True)


def _standard_case(impl: str, heads: int) -> Case:
  def fn(q, k, v):
    return causal_attention(q, k, v, implementation=impl)

  return Case("mha_cudnn" if impl == "cudnn" else "mha_xla", heads, 3, fn, False)


def causal_pairs(seq: int) -> int:
  return seq * (seq + 1) // 2


def lookahead_pairs(seq: int, window) -> int:
  """Pairs (s, j) with s < j <= s + W within the sequence."""
  if window is None or window >= seq:
    return seq * (seq - 1) // 2
  return sum(min(window, seq - 1 - s) for s in range(seq))


def forward_flops(case: Case, batch: int, seq: int, head_dim: int, window) -> float:
  if case.castle:
    per_head = 2 * head_dim * (3 * causal_pairs(seq) + 3 * lookahead_pairs(seq, window))
  else:
    per_head = 4 * head_dim * causal_pairs(seq)
  return float(per_head * batch * case.heads)


def measure(case: Case, batch: int, seq: int, head_dim: int, dtype, iters: int) -> dict:
  shape = (batch, seq, case.heads, head_dim)
  args_sets = []
  for seed in range(2):
    keys = jax.random.split(jax.random.key(seed), case.num_inputs + 1)
    inputs = tuple(jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys[:-1])
    cotangent = jax.random.normal(keys[-1], shape, jnp.float32).astype(dtype)
    args_sets.append(inputs + (cotangent,))

  result = {"impl": case.name, "batch": batch, "seq": seq, "heads": case.heads, "head_dim": head_dim}
  result.update(time_forward_and_gradients(case.fn, case.num_inputs, args_sets, iters))
  return result


def measure_peer(batch: int, seq: int, heads: int, head_dim: int, iters: int) -> dict:
  """Forward and forward+backward times of the PyPI `lookahead-keys-attention` 0.1.2
  Triton CASTLE kernel (PyTorch autograd; gradients of all six inputs).

  Installed only where the benchmark runs (`pip install lookahead-keys-attention==0.1.2`);
  its own causal-query/key/value and lookahead inputs, [batch, heads, seq, head_dim] bf16.
  """
  result = {"impl": "peer_pypi_triton", "batch": batch, "seq": seq, "heads": heads, "head_dim": head_dim}
  try:
    import torch
    from lookahead_keys_attention.lookahead_keys_attention_triton import castle_attention_triton

    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, heads, seq, head_dim)
    inputs = [
      torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_() for _ in range(6)
    ]
    cotangent = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    with torch.no_grad():
      result["fwd_ms"] = torch_median_ms(
        lambda: castle_attention_triton(*inputs, head_dim**-0.5, False), iters, warmup=1
      )

    def forward_backward():
      for x in inputs:
        x.grad = None
      castle_attention_triton(*inputs, head_dim**-0.5, False).backward(cotangent)

    result["fwd_bwd_ms"] = torch_median_ms(forward_backward, iters, warmup=1)
  except Exception as e:  # a missing or failing peer must not lose the other rows
    result["error"] = error_text(e)
  return result


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__)
  parser.add_argument("--seq_lens", type=cl.positive_int_list, default="2048,8192,16384")
  parser.add_argument("--tokens", type=cl.positive_int, default=32768, help="batch * seq for every length")
  parser.add_argument("--heads", type=cl.positive_int, default=9, help="CASTLE heads")
  parser.add_argument("--baseline_heads", type=cl.positive_int, default=16)
  parser.add_argument("--head_dim", type=cl.positive_int, default=128)
  parser.add_argument("--window", type=cl.nonnegative_int, default=0, help="CASTLE-SWL window; 0 = full CASTLE")
  parser.add_argument("--block_size", type=cl.positive_int, default=64, help="block size of the XLA blockwise path")
  parser.add_argument(
    "--impls",
    type=cl.choice_list((*IMPLEMENTATIONS, "cudnn", "xla_mha")),
    default=None,
    help="comma list of CASTLE implementations (reference, xla, triton, mosaic) and standard-attention "
    "baselines (cudnn, xla_mha); default: every CASTLE implementation but reference, and the baseline",
  )
  parser.add_argument(
    "--kernel_configs",
    type=cl.parsed_by(lambda text: kernel_configs(text, KERNEL_CONFIGS), "';'-separated 'impl:key=value,...'"),
    default={},
    help="';'-separated 'impl:key=value,...' kernel configs, e.g. 'triton:block_q=32,block_k=64;triton:block_q=64', "
    "each timed as its own row of that implementation (default: its default config)",
  )
  parser.add_argument(
    "--peer_seq_lens",
    type=cl.optional_positive_int_list,
    default=[],
    help="comma list of lengths at which to time the PyPI lookahead-keys-attention kernel's "
    "forward and forward+backward (slow: ~1.3 s per forward at 2K)",
  )
  parser.add_argument("--peer_iters", type=cl.positive_int, default=3)
  parser.add_argument("--iters", type=cl.positive_int, default=10)
  parser.add_argument("--dtype", choices=cl.DTYPES, default="bfloat16")
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, one timed call: checks the harness runs")
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  if args.smoke:
    smoke_mode()
    args.seq_lens, args.tokens, args.heads, args.baseline_heads, args.head_dim, args.iters = [128], 128, 1, 1, 64, 1
  for seq in args.seq_lens:
    if args.tokens % seq:
      parser.error(f"--tokens ({args.tokens}) must be a multiple of every sequence length ({seq})")
  on_gpu = jax.default_backend() == "gpu"
  impls = args.impls or [*implementations_to_time(IMPLEMENTATIONS).split(","), "cudnn" if on_gpu else "xla_mha"]

  window = args.window or None
  dtype = jnp.dtype(args.dtype)
  configs = args.kernel_configs
  cases = []
  for impl in impls:
    if impl in configs:
      for config in configs[impl]:
        cases.append(_castle_case(impl, args.heads, window, args.block_size, config, f"[{config}]"))
    elif impl in IMPLEMENTATIONS:
      cases.append(_castle_case(impl, args.heads, window, args.block_size))
    else:
      cases.append(_standard_case("cudnn" if impl == "cudnn" else "xla", args.baseline_heads))

  rows = []
  for seq in args.seq_lens:
    batch = args.tokens // seq
    for case in cases:
      row = measure(case, batch, seq, args.head_dim, dtype, args.iters)
      if "error" not in row:
        flops = forward_flops(case, batch, seq, args.head_dim, window)
        row["fwd_tflops"] = flops / row["fwd_ms"] / 1e9
        row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] / 1e9
      rows.append(row)
      print(json.dumps(row), file=sys.stderr, flush=True)

  for seq in args.peer_seq_lens:
    row = measure_peer(args.tokens // seq, seq, args.heads, args.head_dim, args.peer_iters)
    if "error" not in row:
      row["fwd_tflops"] = forward_flops(cases[0], row["batch"], seq, args.head_dim, window) / row["fwd_ms"] / 1e9
      ours = next(
        (r for r in rows if r["seq"] == seq and r["impl"].startswith("castle_triton") and "error" not in r), None
      )
      if ours:
        row["peer_over_ours_fwd"] = row["fwd_ms"] / ours["fwd_ms"]
        if "fwd_bwd_ms" in row:
          row["peer_over_ours_fwd_bwd"] = row["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)

  baseline_name = next((c.name for c in cases if not c.castle), None)
  for row in rows:
    base = next((r for r in rows if r["impl"] == baseline_name and r["seq"] == row["seq"] and "error" not in r), None)
    if base and "error" not in row and "fwd_bwd_ms" in row:
      row["fwd_ratio"] = row["fwd_ms"] / base["fwd_ms"]
      row["fwd_bwd_ratio"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]

  meta = run_meta(dtype=args.dtype, window=window, tokens=args.tokens)
  write_json(args.json, meta, rows=rows)
  print(f"\n{meta['device']} | jax {meta['jax']} | {args.dtype} | window {window} | {args.tokens} tokens")
  print_table(
    rows,
    [
      ("impl", "impl", ""),
      ("batch", "batch", "d"),
      ("T", "seq", "d"),
      ("heads", "heads", "d"),
      *TIME_COLUMNS,
      (f"x {baseline_name} fwd+bwd", "fwd_bwd_ratio", ".2f"),
      PEAK_COLUMN,
      ("peer / ours fwd+bwd", "peer_over_ours_fwd_bwd", ".0f"),
    ],
  )
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
