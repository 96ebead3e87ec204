"""CASTLE backward as a Pallas Mosaic GPU (Hopper: wgmma + TMA) kernel, key-block major.

The math is that of the Triton backward (`pallas_kernels.castle.triton_kernels`): one program
per (key block b, batch * head) sweeps the query blocks in reverse, i = N-1 .. b. It
starts from the forward's final lookahead-key state D_b and walks it back with exactly
the forward's float16 product, D^(i) = D^(i+1) - W_bi V^U_i (the paper's Eq. 37),
recomputes the step's scores and probabilities, and carries dD (Algorithm 3) and the
key block's gradients dK^C, dV^C, dQ^U across the sweep. Per step, with tiles in the
key-row frame ([block_k, block_q]: keys down, queries across; ^T marks such a tile):

  W        = sigmoid(Q^U_b K^U_i^T s) under the lookahead mask
  D       -= W V^U_i                                       (float16 operands, as the forward)
  S^U^T    = D Q^C_i^T s + W R_ii^T                         (float16 operands, as the forward)
  P^T      = exp(K^C_b Q^C_i^T s - SiLU(S^U^T) - lse_i) under the causal mask
  dV^C    += P^T dO_i,    dP^T = V^C_b dO_i^T,    dS^T = P^T (dP^T - delta_i)
  dK^C    += dS^T Q^C_i s,     dSU^T = -dS^T SiLU'(S^U^T)
  dQ^C_i  += (dS K^C_b + dSU D) s,    dR_ii += dSU W       (reduce-adds to global memory)
  dW       = dSU^T R_ii + dD V^U_i^T,    dV^U_i += W^T dD   (dD before this step's term)
  dD      += dSU^T Q^C_i s
  dL       = dW W (1 - W) s,    dQ^U += dL K^U_i,    dK^U_i += dL^T Q^U_b

dR (the gradient of the in-block scores R = Q^C V^U^T s, precomputed in XLA) is folded
into dQ^C and dV^U by the caller, as on the Triton path.

Two warpgroups per program, split by role so that the per-key-block state fits in
registers at head dim 128 (five [64, d] float32 tiles would be 320 registers per
thread in one warpgroup):
  - the score warpgroup holds D and dD, loads the tiles, computes every score tile and
    all of the step's elementwise work, and adds the query-block gradients dQ^C, dK^U,
    dV^U and dR into global memory (TMA reduce-adds);
  - the accumulator warpgroup holds dK^C, dV^C and dQ^U and runs their three products
    from tiles the score warpgroup leaves in shared memory (P^T, dS^T, dL).
The accumulator warpgroup's three products need only 16-bit tiles that are staged
anyway; no float32 tile and nothing of D crosses between the warpgroups. The schedule is
synchronous (each wgmma waited on, one buffer per tile).

CASTLE-SWL: the pairs past each key block's window run in the kernels of
`mosaic_backward_past_window` (dQ^C query-block major; dK^C, dV^C and dD key-block major,
first, so that this sweep starts its walk back from their dD); this sweep covers the
rest.

Every [64, d] tile is handled as d / 64 column chunks of [64, 64]: register state,
shared-memory staging and the float32 reduce-adds all stay at 64 columns, which keeps
the shared memory within Hopper's 227 KB at d = 128.

Precision: the products that recompute the forward (W V^U, D Q^C^T, W R^T) take the
forward's float16 operands, so P matches the forward's probabilities; the causal
gradient products take the inputs' dtype (as flash attention); the lookahead gradient
products take float16 (W in [0, 1], dSU, dD, D scaled by 2^-8, Q^C, V^U and R), so
those gradients must stay within float16's normal range: the caller scales dO per
(batch, head) to max |dO| in [0.5, 1) by a power of two and divides the gradients by it
(`mosaic.cotangent_scale`; a training loss's dO of ~1e-6 would otherwise
reach these products as subnormals).
GPU interpret mode differs in two places, as in the forward: a wgmma accumulator that
starts from a value is added to afterwards, and the reduce-adds read, add and write back.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels.castle import mosaic_math, mosaic_backward_past_window
from pallas_kernels.castle.config import KEY_BLOCKS_PER_PROGRAM, WGMMA_ROWS, CastleMosaicConfig
from pallas_kernels.castle.mosaic_forward import (
  KEY_STATE_SCALE,
  LOOKAHEAD_DTYPE,
  key_major_launch,
  key_major_sweep_end,
  step_masks as _step_masks,
  window_interior_end,
)
from pallas_kernels.mosaic_common import (
  operand_smem,
  products as wgmma_products,
  reduce_add_tiles,
  run_on_zeroed_refs,
  wgmma_zeros,
)

# Columns per chunk of a [64, head_dim] tile: one 128-byte swizzle span of 16-bit values.
CHUNK = 64
_SCORE_WARPGROUP = 0
_ACCUMULATOR_WARPGROUP = 1
# Tiles loaded once per program (the key block), per step (a query block), and per step
# that meets a nonzero lookahead weight (all steps without a window).
_KEY_TILES = ("q_u", "k_c", "v_c")
_QUERY_TILES = ("q_c", "q_c16", "d_out", "lse", "delta")
_LOOKAHEAD_TILES = ("k_u", "v_u16", "in_block_t")


class _Staging(NamedTuple):
  """Shared-memory tiles the score warpgroup writes each step (key-row frame)."""

  weights: object  # W, float16 [block_k, block_q]
  probs: object  # P^T, input dtype
  d_scores: object  # dS^T, input dtype
  d_lookahead: object  # dSU^T, float16
  d_logits: object  # dL, input dtype
  keys: tuple  # D * 2^-8, float16, one [block_k, CHUNK] tile per column chunk
  d_keys: tuple  # dD, float16, per column chunk


class _Barriers(NamedTuple):
  keys: object  # the key-block tiles have landed
  query: object  # the step's query tiles have landed
  lookahead: object  # the step's lookahead tiles (K^U, V^U, R) have landed
  io: object  # the score warpgroup's own copies into `out_smem`
  probs_ready: object  # P^T is staged (score -> accumulator warpgroup)
  grads_ready: object  # dS^T and dL are staged (score -> accumulator warpgroup)
  consumed: object  # the accumulator warpgroup is done with the step's tiles
  staging_free: object  # the score warpgroup's last reduce-add has read `out_smem`
  epilogue: object  # GPU interpret mode: the accumulator warpgroup's final reduce-adds' reads


class _Sweep:
  """The reverse sweep of one key block's program, as segments of steps that differ in
  what they compute (the step function takes them as static flags):

    - CASTLE-SWL: from the sweep's `top` (`key_major_sweep_end`; the pairs after it are
      `mosaic_backward_past_window`'s) down to the key block's window end, W is zero, so D
      is constant and W, R, dW, dV^U, dK^U, dQ^U drop out (`with_lookahead=False`); then
      the blocks within reach of the window: masked at its edge, unmasked between the
      diagonal and the edge (`window_interior_end`), masked on the diagonal;
    - CASTLE: the blocks after the diagonal, where every query follows every key and no
      mask is needed, then the diagonal block, masked.
  """

  def __init__(self, key_block, block_q: int, block_k: int, num_query_blocks: int, window: int | None):
    if block_q != block_k:
      raise ValueError(f"the backward sweep takes block_q == block_k, got {block_q} and {block_k}")
    self.first = key_block
    self.num_query_blocks = num_query_blocks
    self.window = window
    # One past the sweep's first (highest) query block.
    self.top = num_query_blocks
    if window is not None:
      self.lookahead_end = jnp.minimum(num_query_blocks, lax.div((key_block + 1) * block_k - 1 + window, block_q) + 1)
      self.interior_end = window_interior_end(
        key_block * block_k, key_block + 1, self.lookahead_end, window=window, block_q=block_q
      )
      # The past-window kernels work on key programs of the forward's size.
      self.top = key_major_sweep_end(
        lax.div(key_block, KEY_BLOCKS_PER_PROGRAM),
        window=window,
        block_q=block_q,
        block_k=block_k,
        num_query_blocks=num_query_blocks,
      )

  def run(self, step, carry):
    def reverse(start, stop, carry, **flags):
      return lax.fori_loop(0, stop - start, lambda r, c: step(stop - 1 - r, c, **flags), carry)

    if self.window is not None:
      carry = reverse(self.lookahead_end, self.top, carry, with_lookahead=False, masked=False)
      # Inside the window only the diagonal block and the window's edge need masks.
      carry = reverse(self.interior_end, self.lookahead_end, carry, with_lookahead=True, masked=True)
      carry = reverse(self.first + 1, self.interior_end, carry, with_lookahead=True, masked=False)
      return step(self.first, carry, with_lookahead=True, masked=True)
    carry = reverse(self.first + 1, self.num_query_blocks, carry, with_lookahead=True, masked=False)
    return step(self.first, carry, with_lookahead=True, masked=True)


def _columns(ref, chunk: int, num_chunks: int):
  """Column chunk `chunk` of a [rows, num_chunks * CHUNK] reference (the last axis)."""
  if num_chunks == 1:
    return ref
  return ref.at[..., pl.ds(chunk * CHUNK, CHUNK)]


def _store_tile(tile, gmem, out_smem):
  """gmem = tile (float32) through the staging buffer `out_smem`."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  out_smem[...] = tile
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, gmem)


def _phase(name: str, *, with_lookahead: bool):
  """A named region of a step, the unit of a Mosaic GPU profile
  (`plgpu.CompilerParams(profile_space=..., profile_dir=...)`): steps that walk D back
  ("lookahead: ...") and CASTLE-SWL's steps past the window ("past window: ...")."""
  return jax.named_scope(("lookahead: " if with_lookahead else "past window: ") + name)


def _backward_kernel(
  q_u_ref,
  k_c_ref,
  v_c_ref,
  keys_ref,
  *refs,
  scale: float,
  window: int | None,
  block_q: int,
  block_k: int,
  num_query_blocks: int,
  head_dim: int,
  interpreted: bool,
):
  # CASTLE-SWL: dD starts from the share of the pairs past the window.
  past_window = window is not None
  d_keys_ref, refs = (refs[0], refs[1:]) if past_window else (None, refs)
  (
    q_c_ref,
    q_c16_ref,
    k_u_ref,
    v_u16_ref,
    d_out_ref,
    in_block_t_ref,
    lse_ref,
    delta_ref,
    dq_c_ref,
    dk_u_ref,
    dv_u_ref,
    d_in_block_ref,  # float32 accumulators in global memory
    dq_u_ref,
    dk_c_ref,
    dv_c_ref,  # outputs: the key block's gradients
    key_smem,
    query_smem,
    in_block_smem,
    lse_smem,
    delta_smem,
    staging,
    out_smem,
    barriers,
  ) = refs
  products = functools.partial(wgmma_products, init_in_place=not interpreted)
  # gmem += tile (float32) through the one staging buffer `out_smem`.
  reduce_add = lambda tile, gmem: reduce_add_tiles([(tile, gmem, out_smem)], barriers.io, with_tma=not interpreted)
  num_chunks = head_dim // CHUNK
  chunks = range(num_chunks)
  key_block = lax.axis_index("key_block")
  head = lax.axis_index("head")
  warpgroup = lax.axis_index("wg")
  key_rows = pl.ds(key_block * block_k, block_k)
  q_u_smem, k_c_smem, v_c_smem = key_smem
  q_c_smem, q_c16_smem, k_u_smem, v_u16_smem, d_out_smem = query_smem
  dtype = q_c_ref.dtype
  gmem_columns = lambda ref, rows, c: _columns(ref.at[head, rows], c, num_chunks)
  tile = (block_k, block_q)
  chunk_tile = (block_k, CHUNK)

  sweep = _Sweep(key_block, block_q, block_k, num_query_blocks, window)

  @pl.when(warpgroup == _SCORE_WARPGROUP)
  def _():
    for src, dst in zip((q_u_ref, k_c_ref, v_c_ref), key_smem):
      plgpu.copy_gmem_to_smem(src.at[head, key_rows], dst, barriers.keys)

    def load_state(ref):
      state = []
      for c in chunks:
        plgpu.copy_gmem_to_smem(gmem_columns(ref, key_rows, c), out_smem, barriers.io)
        plgpu.barrier_wait(barriers.io)
        state.append(plgpu.load(out_smem, layout=plgpu.Layout.WGMMA))
        plgpu.commit_smem()  # the next copy overwrites what was just read
      return state

    with jax.named_scope("prologue: D, dD and the key tiles"):
      keys = load_state(keys_ref)
      d_keys = [wgmma_zeros(chunk_tile) for _ in chunks] if d_keys_ref is None else load_state(d_keys_ref)
      plgpu.barrier_wait(barriers.keys)

    def stage_keys(keys):
      for c in chunks:
        staging.keys[c][...] = (keys[c] * KEY_STATE_SCALE).astype(LOOKAHEAD_DTYPE)
      plgpu.commit_smem()

    def step(query_block, carry, *, with_lookahead: bool, masked: bool):
      keys, d_keys = carry
      rows = pl.ds(query_block * block_q, block_q)
      phase = functools.partial(_phase, with_lookahead=with_lookahead)

      with phase("wait for the accumulator warpgroup"):

        @pl.when(query_block < sweep.top - 1)  # not the sweep's first step
        def _():
          plgpu.barrier_wait(barriers.consumed)

      with phase("load query tiles"):
        for src, dst in zip((q_c_ref, q_c16_ref, d_out_ref), (q_c_smem, q_c16_smem, d_out_smem)):
          plgpu.copy_gmem_to_smem(src.at[head, rows], dst, barriers.query)
        plgpu.copy_gmem_to_smem(lse_ref.at[head, rows], lse_smem, barriers.query)
        plgpu.copy_gmem_to_smem(delta_ref.at[head, rows], delta_smem, barriers.query)
        if with_lookahead:
          for src, dst in zip((k_u_ref, v_u16_ref, in_block_t_ref), (k_u_smem, v_u16_smem, in_block_smem)):
            plgpu.copy_gmem_to_smem(src.at[head, rows], dst, barriers.lookahead)
        plgpu.barrier_wait(barriers.query)
      causal_mask, visible = (
        _step_masks(key_block * block_k, query_block * block_q, tile, window) if masked else (None, None)
      )

      if with_lookahead:
        with phase("walk D back"):
          # W, then D^(i+1) -> D^(i) with the forward's float16 product.
          plgpu.barrier_wait(barriers.lookahead)
          weights = mosaic_math.sigmoid(products([(q_u_smem, k_u_smem.T)], tile) * scale)
          if masked:
            weights = jnp.where(visible, weights, 0.0)
          staging.weights[...] = weights.astype(LOOKAHEAD_DTYPE)
          plgpu.commit_smem()
          keys = [
            keys[c] - products([(staging.weights, _columns(v_u16_smem, c, num_chunks))], chunk_tile) for c in chunks
          ]
          stage_keys(keys)
      # Past the window (CASTLE-SWL) W is zero and D^(i) = D^(i+1), staged already.

      with phase("scores"):
        # The forward's scores and probabilities.
        lookahead_pairs = [(staging.keys[c], _columns(q_c16_smem, c, num_chunks).T) for c in chunks]
        lookahead = products(lookahead_pairs, tile) * (scale / KEY_STATE_SCALE)
        if with_lookahead:
          lookahead = products([(staging.weights, in_block_smem)], tile, init=lookahead)
        causal = products([(k_c_smem, q_c_smem.T)], tile) * scale
        lse = lax.broadcast_in_dim(lse_smem[...], tile, [1])
        probs = jnp.exp(causal - mosaic_math.silu(lookahead) - lse)
        if masked:
          probs = jnp.where(causal_mask, probs, 0.0)
        staging.probs[...] = probs.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_arrive(barriers.probs_ready)

      with phase("score gradients"):
        # Softmax and the SiLU.
        d_probs = products([(v_c_smem, d_out_smem.T)], tile)
        d_scores = probs * (d_probs - lax.broadcast_in_dim(delta_smem[...], tile, [1]))
        d_lookahead = -d_scores * mosaic_math.silu_grad(lookahead)
        staging.d_scores[...] = d_scores.astype(dtype)
        staging.d_lookahead[...] = d_lookahead.astype(LOOKAHEAD_DTYPE)
        if with_lookahead:
          for c in chunks:
            staging.d_keys[c][...] = d_keys[c].astype(LOOKAHEAD_DTYPE)
        plgpu.commit_smem()

      with phase("dQ^C"):
        # dQ^C_i = (dS K^C_b + dSU D^(i)) * scale, with D entering scaled by 2^-8.
        for c in chunks:
          from_keys = products([(staging.d_lookahead.T, staging.keys[c])], (block_q, CHUNK))
          dq_c = products(
            [(staging.d_scores.T, _columns(k_c_smem, c, num_chunks))],
            (block_q, CHUNK),
            init=from_keys * (1.0 / KEY_STATE_SCALE),
          )
          reduce_add(dq_c * scale, gmem_columns(dq_c_ref, rows, c))

      if with_lookahead:
        with phase("dR, dW, dV^U"):
          # dR_ii = dSU W (the caller masks and scales it).
          reduce_add(
            products([(staging.d_lookahead.T, staging.weights)], (block_q, block_q)), d_in_block_ref.at[head, rows]
          )
          # W's gradient: through the in-block term R W^T and through D^(i+1) (dD before
          # this step's term).
          d_weights = products(
            [(staging.d_lookahead, in_block_smem.T)]
            + [(staging.d_keys[c], _columns(v_u16_smem, c, num_chunks).T) for c in chunks],
            tile,
          )
          for c in chunks:
            reduce_add(
              products([(staging.weights.T, staging.d_keys[c])], (block_q, CHUNK)), gmem_columns(dv_u_ref, rows, c)
            )
      with phase("dD"):
        # dD becomes dL/dD^(i): add what this query block's scores read from D^(i).
        d_keys = [
          d_keys[c] + products([(staging.d_lookahead, _columns(q_c16_smem, c, num_chunks))], chunk_tile) * scale
          for c in chunks
        ]

      with phase("dK^U"):
        if with_lookahead:
          weights = staging.weights[...].astype(jnp.float32)
          staging.d_logits[...] = (d_weights * weights * (1.0 - weights) * scale).astype(dtype)
          plgpu.commit_smem()
        plgpu.barrier_arrive(barriers.grads_ready)
        if with_lookahead:
          for c in chunks:
            reduce_add(
              products([(staging.d_logits.T, _columns(q_u_smem, c, num_chunks))], (block_q, CHUNK)),
              gmem_columns(dk_u_ref, rows, c),
            )
      return keys, d_keys

    stage_keys(keys)
    sweep.run(step, (keys, d_keys))
    plgpu.wait_smem_to_gmem(0)
    plgpu.barrier_arrive(barriers.staging_free)
    plgpu.barrier_wait(barriers.consumed)

  @pl.when(warpgroup == _ACCUMULATOR_WARPGROUP)
  def _():
    with jax.named_scope("prologue: the key tiles"):
      plgpu.barrier_wait(barriers.keys)

    def step(_, carry, *, with_lookahead: bool, masked: bool):
      del masked  # only the score warpgroup masks
      dk_c, dv_c, dq_u = carry
      phase = functools.partial(_phase, with_lookahead=with_lookahead)
      with phase("wait for P"):
        plgpu.barrier_wait(barriers.query)
        if with_lookahead:
          plgpu.barrier_wait(barriers.lookahead)
        plgpu.barrier_wait(barriers.probs_ready)
      with phase("dV^C"):
        dv_c = [
          products([(staging.probs, _columns(d_out_smem, c, num_chunks))], chunk_tile, init=dv_c[c]) for c in chunks
        ]
      with phase("wait for dS"):
        plgpu.barrier_wait(barriers.grads_ready)
      with phase("dK^C, dQ^U"):
        dk_c = [
          products([(staging.d_scores, _columns(q_c_smem, c, num_chunks))], chunk_tile, init=dk_c[c]) for c in chunks
        ]
        if with_lookahead:
          dq_u = [
            products([(staging.d_logits, _columns(k_u_smem, c, num_chunks))], chunk_tile, init=dq_u[c]) for c in chunks
          ]
        plgpu.barrier_arrive(barriers.consumed)
      return dk_c, dv_c, dq_u

    zeros = [wgmma_zeros(chunk_tile) for _ in chunks]
    dk_c, dv_c, dq_u = sweep.run(step, (zeros, zeros, zeros))
    plgpu.barrier_wait(barriers.staging_free)
    # CASTLE-SWL: the key-side kernel has written the share of the pairs past the window
    # into dK^C and dV^C already.
    for grads, ref, factor, add in (
      (dk_c, dk_c_ref, scale, past_window),
      (dv_c, dv_c_ref, 1.0, past_window),
      (dq_u, dq_u_ref, 1.0, False),
    ):
      for c in chunks:
        gmem = gmem_columns(ref, key_rows, c)
        if add:
          reduce_add_tiles([(grads[c] * factor, gmem, out_smem)], barriers.epilogue, with_tma=not interpreted)
        else:
          _store_tile(grads[c] * factor, gmem, out_smem)
    plgpu.wait_smem_to_gmem(0)


def backward(
  q_u,
  k_u,
  v_u,
  q_c,
  k_c,
  v_c,
  keys_final,
  d_out,
  lse,
  delta,
  in_block_t,
  *,
  scale: float,
  window: int | None,
  config: CastleMosaicConfig,
  interpret,
):
  """The Mosaic GPU backward kernel on padded [BH, L, d] arrays.

  Args:
    q_u, k_u, q_c, k_c, v_c: [BH, L, d] in the inputs' dtype (bf16 or f16); L a
      multiple of config.block_q and config.block_k, d a multiple of 64.
    v_u: [BH, L, d], the lookahead values (enter as float16, as in the forward).
    keys_final: float32 [BH, L, d], the forward's final D (the lookahead keys u_s^L).
    d_out: [BH, L, d], the output cotangent in the inputs' dtype.
    lse: float32 [BH, L], the rows' log-sum-exp of the scores.
    delta: float32 [BH, L], rowsum(out * d_out).
    in_block_t: float [BH, L, block_q], the R_ii^T tiles (`mosaic._in_block_scores_transposed`);
      they enter the products as float16, as in the forward.
    scale: the score scale.
    window: None or the CASTLE-SWL window.
    interpret: None, or `plgpu.InterpretGPUParams` to run in GPU interpret mode.

  Returns:
    dq_u, dk_c, dv_c, dq_c, dk_u, dv_u: float32 [BH, L, d] (dq_c and dv_u without the
    in-block term's share), d_in_block: float32 [BH, L, block_q], dL/dR_ii (rows of
    query block i, unmasked and unscaled).
  """
  heads, length, head_dim = q_c.shape
  block_q, block_k = config.block_q, config.block_k
  if block_q != WGMMA_ROWS or block_k != WGMMA_ROWS or head_dim % CHUNK:
    raise ValueError(
      f"mosaic_backward.backward takes block_q = block_k = {WGMMA_ROWS} and a head dim that is a "
      f"multiple of {CHUNK}; got {block_q}, {block_k} and {head_dim}"
    )
  dtype = q_c.dtype
  num_chunks = head_dim // CHUNK
  # CASTLE-SWL: dQ^C of the pairs past the window comes from the query-major kernel, and
  # their dK^C, dV^C and dD from a key-major kernel of their own.
  split = window is not None
  kernel = functools.partial(
    _backward_kernel,
    scale=scale,
    window=window,
    block_q=block_q,
    block_k=block_k,
    num_query_blocks=length // block_q,
    head_dim=head_dim,
    interpreted=interpret is not None,
  )
  full_tile = lambda rows, dt: operand_smem((rows, head_dim), dt)
  square = lambda dt: operand_smem((block_k, block_q), dt)
  chunk = lambda dt: tuple(operand_smem((block_k, CHUNK), dt) for _ in range(num_chunks))
  scratch = [
    (full_tile(block_k, dtype),) * len(_KEY_TILES),
    (
      full_tile(block_q, dtype),
      full_tile(block_q, LOOKAHEAD_DTYPE),
      full_tile(block_q, dtype),
      full_tile(block_q, LOOKAHEAD_DTYPE),
      full_tile(block_q, dtype),
    ),
    operand_smem((block_q, block_q), LOOKAHEAD_DTYPE),
    plgpu.SMEM((block_q,), jnp.float32),
    plgpu.SMEM((block_q,), jnp.float32),
    _Staging(
      weights=square(LOOKAHEAD_DTYPE),
      probs=square(dtype),
      d_scores=square(dtype),
      d_lookahead=square(LOOKAHEAD_DTYPE),
      d_logits=square(dtype),
      keys=chunk(LOOKAHEAD_DTYPE),
      d_keys=chunk(LOOKAHEAD_DTYPE),
    ),
    plgpu.SMEM((WGMMA_ROWS, CHUNK), jnp.float32),
    # A barrier completes when every copy (or warpgroup) that signals it has arrived.
    _Barriers(
      keys=plgpu.Barrier(num_arrivals=len(_KEY_TILES)),
      query=plgpu.Barrier(num_arrivals=len(_QUERY_TILES)),
      lookahead=plgpu.Barrier(num_arrivals=len(_LOOKAHEAD_TILES)),
      io=plgpu.Barrier(num_arrivals=1),
      probs_ready=plgpu.Barrier(num_arrivals=1),
      grads_ready=plgpu.Barrier(num_arrivals=1),
      consumed=plgpu.Barrier(num_arrivals=1),
      staging_free=plgpu.Barrier(num_arrivals=1),
      epilogue=plgpu.Barrier(num_arrivals=1),
    ),
  ]
  launch = key_major_launch(
    kernel, scratch, length=length, heads=heads, keys_per_program=block_k, interpret=interpret, num_threads=2
  )
  past_window = dict(
    scale=scale,
    window=window,
    block_q=block_q,
    block_k=block_k,
    keys_per_program=config.keys_per_program,
    interpret=interpret,
  )
  query_tiles = (
    q_c.astype(LOOKAHEAD_DTYPE),
    k_u,
    v_u.astype(LOOKAHEAD_DTYPE),
    d_out,
    in_block_t.astype(LOOKAHEAD_DTYPE),
    lse,
    delta,
  )
  rows = jax.ShapeDtypeStruct((heads, length, head_dim), jnp.float32)
  # dQ^C, dK^U, dV^U and dR are reduce-added into; dQ^U is written; dK^C and dV^C are
  # written, or under a window written by the key-side kernel (with dD, which the
  # sweep starts its walk back from) and then reduce-added into by the sweep.
  types = (rows, rows, rows, jax.ShapeDtypeStruct((heads, length, block_q), jnp.float32), rows, rows, rows)

  def sweeps(dq_c, dk_u, dv_u, d_in_block, dq_u, dk_c, dv_c, *d_keys):
    if split:
      mosaic_backward_past_window.key_grads_into(
        q_c, k_c, keys_final, v_c, d_out, lse, delta, dk_c, dv_c, *d_keys, **past_window
      )
    launch(q_u, k_c, v_c, keys_final, *d_keys, q_c, *query_tiles, dq_c, dk_u, dv_u, d_in_block, dq_u, dk_c, dv_c)
    if split:
      mosaic_backward_past_window.accumulate_query_grads(
        q_c, k_c, keys_final, v_c, d_out, lse, delta, dq_c, **past_window
      )

  dq_c, dk_u, dv_u, d_in_block, dq_u, dk_c, dv_c, *_ = run_on_zeroed_refs(sweeps, types + ((rows,) if split else ()))
  return dq_u, dk_c, dv_c, dq_c, dk_u, dv_u, d_in_block
