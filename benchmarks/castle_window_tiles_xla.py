"""CASTLE-SWL's pairs inside the window as batched XLA tile products, timed (H100).

    python -m benchmarks.castle_window_tiles_xla [--heads=18] [--seq=16384] [--window=512] [--iters=10]

The Mosaic kernels walk each key block's lookahead state D through the window one query
block at a time: a serial chain of small products per key block. This benchmark times the
alternative without any serial state. With the score scale folded into VS,

  S^U[t, s] = sum_j VS[t, j] sig[s, j],  VS = Q^C V^U^T * scale (j <= t),
                                         sig = sigmoid(Q^U K^U^T * scale) (s < j <= s + W),

so for query block i and key block k = i - delta (64-row tiles), j runs over the blocks
m = k .. i and S^U(i, k) = sum_{m=k}^{i} VS(i, m) sig(k, m)^T: every term one
[64 x 64 x 64] product, batched over (head, block) and over the window's tile diagonals.
`window_tiles` computes the window's tiles (delta < diagonals) this way, adds their
exp(A - shift) V^C and row sums, and returns the final lookahead keys D (the
past-window kernels' input). The benchmark times its forward and its gradient (XLA
autodiff) at the CASTLE-SWL-XL attention shape; `benchmarks/castle_mosaic_swl_kernels.py
--only="window part"` times the kernels' forward over the same pairs.

Measured on the H100 (benchmarks/RESULTS.md, ninth round) it is 5x the kernels' forward,
so the window stays in the kernels; the function is kept as the measured record and as a
second oracle of the tile algebra (tests/test_castle_window_tiles_xla.py checks it against
`castle_parallel`).
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np


from benchmarks.timing import median_ms, run_meta, write_json  # noqa: E402
from castle_jax import command_line as cl  # noqa: E402

TILE = 64


def _from_block(x: jax.Array, offset: int) -> jax.Array:
  """x[:, n + offset] along the block axis 1, zeros where n + offset is out of range."""
  if offset == 0:
    return x
  blocks = x.shape[1]
  pad = [(0, 0)] * x.ndim
  pad[1] = (max(-offset, 0), max(offset, 0))
  padded = jnp.pad(x, pad)
  start = max(offset, 0)
  return padded[:, start : start + blocks]


def window_tiles(
  q_u, k_u, v_u, q_c, k_c, v_c, shift, *, window: int, diagonals: int, dtype=jnp.bfloat16
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The tiles (i, i - delta), delta < diagonals, of CASTLE-SWL with a fixed softmax shift.

  Args:
    q_u, k_u, v_u, q_c, k_c, v_c: [heads, seq, head_dim], seq a multiple of 64.
    shift: float32 [heads, seq], each query row's softmax shift.
    window: the CASTLE-SWL window W >= 1.
    diagonals: tile diagonals to cover; (W + 63) // 64 + 1 covers every pair inside the
      window, seq // 64 every causal pair.
    dtype: the products' operand dtype (float32 accumulation).

  Returns:
    (acc float32 [heads, seq, head_dim], sums float32 [heads, seq], final_keys float32
    [heads, seq, head_dim]): sum of exp(A - shift) V^C and of exp(A - shift) over the
    tiles' pairs, and the final lookahead keys u_s^L.
  """
  heads, seq, head_dim = q_c.shape
  blocks = seq // TILE
  if seq % TILE or window < 1 or diagonals < 1:
    raise ValueError(
      f"window_tiles: seq must be a multiple of {TILE} (got {seq}), window and diagonals >= 1 "
      f"(got {window}, {diagonals})"
    )
  scale = head_dim**-0.5
  to_blocks = lambda x: x.astype(dtype).reshape(heads, blocks, TILE, head_dim)
  q_u, k_u, v_u, q_c, k_c, v_c = (to_blocks(x) for x in (q_u, k_u, v_u, q_c, k_c, v_c))
  shift = shift.reshape(heads, blocks, TILE)
  rows = jnp.arange(TILE)
  block_ids = jnp.arange(blocks)[None, :, None, None]
  product = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)
  diagonals = min(diagonals, blocks)
  reach = min((window + TILE - 1) // TILE + 1, blocks)  # j-blocks k + e holding some s < j <= s + W

  # sig[e]: key block k against j-block k + e.
  sig = []
  for e in range(reach):
    j = e * TILE + rows[None, :]
    visible = (j > rows[:, None]) & (j <= rows[:, None] + window) & (block_ids + e < blocks)
    logits = product("bnsd,bnjd->bnsj", q_u, _from_block(k_u, e)) * scale
    sig.append(jnp.where(visible, jax.nn.sigmoid(logits), 0.0).astype(dtype))
  final_keys = sum(product("bnsj,bnjd->bnsd", sig[e], _from_block(v_u, e)) for e in range(reach))

  # vs[a]: query block i against j-block i - a (j <= t inside the diagonal block).
  vs = []
  for a in range(diagonals):
    scores = product("bntd,bnjd->bntj", q_c, _from_block(v_u, -a)) * scale
    if a == 0:
      scores = jnp.where(rows[:, None] >= rows[None, :], scores, 0.0)
    vs.append(scores.astype(dtype))

  acc = jnp.zeros((heads, blocks, TILE, head_dim), jnp.float32)
  sums = jnp.zeros((heads, blocks, TILE), jnp.float32)
  for delta in range(diagonals):
    lookahead = sum(
      product("bntj,bnsj->bnts", vs[delta - e], _from_block(sig[e], -delta)) for e in range(min(delta + 1, reach))
    )
    causal = product("bntd,bnsd->bnts", q_c, _from_block(k_c, -delta)) * scale
    visible = block_ids >= delta
    if delta == 0:
      visible = visible & (rows[:, None] >= rows[None, :])
    probs = jnp.where(visible, jnp.exp(causal - jax.nn.silu(lookahead) - shift[..., None]), 0.0)
    acc = acc + product("bnts,bnsd->bntd", probs.astype(dtype), _from_block(v_c, -delta))
    sums = sums + probs.sum(-1)
  return (acc.reshape(heads, seq, head_dim), sums.reshape(heads, seq), final_keys.reshape(heads, seq, head_dim))


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--heads", type=cl.positive_int, default=18, help="batch x heads")
  parser.add_argument("--seq", type=cl.positive_int, default=16384)
  parser.add_argument("--window", type=cl.positive_int, default=512)
  parser.add_argument("--iters", type=cl.positive_int, default=10)
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  shape = (args.heads, args.seq, 128)
  inputs = tuple(jnp.asarray(rng.normal(size=shape) * 0.5, jnp.bfloat16) for _ in range(6))
  shift = jnp.full(shape[:2], 4.0, jnp.float32)
  diagonals = (args.window + TILE - 1) // TILE + 1
  tiles = functools.partial(window_tiles, shift=shift, window=args.window, diagonals=diagonals)
  cotangents = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in (shape, shape[:2], shape))

  def loss(*x):
    return sum(jnp.sum(y * c) for y, c in zip(tiles(*x), cotangents))

  rows = {
    "fwd": median_ms(jax.jit(tiles), [inputs], args.iters),
    "fwd+bwd": median_ms(jax.jit(jax.grad(loss, argnums=tuple(range(6)))), [inputs], args.iters),
  }
  write_json(args.json, run_meta(**vars(args)), rows=rows)
  print(
    f"{args.heads} x {args.seq} x 128, window {args.window}, {diagonals} tile diagonals, "
    f"{jax.devices()[0].device_kind}, jax {jax.__version__}"
  )
  print("| window tiles in XLA | ms |\n| --- | --- |")
  for name, ms in rows.items():
    print(f"| {name} | {ms:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
