"""Discounted cumulative sum of chunk states (and its backward) as single Pallas kernels.

The recurrence S_{c+1} = e^{total_c} S_c + dS_c runs over the n chunks of a sequence; as
an XLA scan it is n small launches, each moving one chunk's states (launch-bound). Here one
program owns a [rows, cols] slab
of the state of one head and walks all chunks in a loop, so the whole recurrence is one
launch that streams dS in and the entering states out once (bandwidth-bound).

Arrays are [BH, n, R, C] (R, C the state's rows and columns; normalizers are passed as
[BH, n, D / 16, 16]); totals are [BH, n] float32 log-decays.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

MAX_SLAB_ROWS = 64


def _slab_rows(rows: int, cols: int) -> int:
  """The largest power of two <= MAX_SLAB_ROWS (and <= 4096 / cols) that divides `rows`."""
  slab = 1
  while slab * 2 <= MAX_SLAB_ROWS and slab * 2 * cols <= 4096 and rows % (slab * 2) == 0:
    slab *= 2
  return slab


def _specs(slab: int, cols: int, num_chunks: int):
  """BlockSpecs of a [slab, cols] piece of a head's state: all chunks, the totals, one state."""
  per_chunk = pl.BlockSpec((None, num_chunks, slab, cols), lambda b, r: (b, 0, r, 0))
  totals = pl.BlockSpec((None, num_chunks), lambda b, r: (b, 0))
  state = pl.BlockSpec((None, slab, cols), lambda b, r: (b, r, 0))
  return per_chunk, totals, state


def _discumsum_kernel(delta_ref, totals_ref, initial_ref, entering_ref, final_ref):
  def step(c, state):
    entering_ref[c] = state.astype(entering_ref.dtype)
    return jnp.exp(totals_ref[c]) * state + delta_ref[c]

  final_ref[...] = lax.fori_loop(0, delta_ref.shape[0], step, initial_ref[...])


def discumsum(
  deltas: jax.Array,
  totals: jax.Array,
  initial: jax.Array,
  *,
  entering_dtype=jnp.float32,
  interpret: bool,
  num_warps: int = 4,
) -> tuple[jax.Array, jax.Array]:
  """States entering each chunk and the final state.

  Args:
    deltas: [BH, n, R, C] float32, each chunk's own contribution dS_c.
    totals: [BH, n] float32, each chunk's total log-decay.
    initial: [BH, R, C] float32, the state before the first chunk.
    entering_dtype: dtype of the entering states (bf16 halves what the readers load).

  Returns:
    entering [BH, n, R, C] (S_c, in `entering_dtype`) and final [BH, R, C] float32 (S_n).
  """
  bh, num_chunks, rows, cols = deltas.shape
  slab = _slab_rows(rows, cols)
  per_chunk, totals_spec, state = _specs(slab, cols, num_chunks)
  return pl.pallas_call(
    _discumsum_kernel,
    grid=(bh, rows // slab),
    in_specs=[per_chunk, totals_spec, state],
    out_specs=[per_chunk, state],
    out_shape=[jax.ShapeDtypeStruct(deltas.shape, entering_dtype), jax.ShapeDtypeStruct(initial.shape, jnp.float32)],
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    interpret=interpret,
    name="power_discumsum",
  )(deltas, totals, initial)


def _reverse_discumsum_kernel(
  d_entering_ref, totals_ref, entering_ref, d_final_ref, d_deltas_ref, d_totals_ref, d_initial_ref
):
  num_chunks = d_entering_ref.shape[0]

  def step(i, d_next):
    c = num_chunks - 1 - i
    d_deltas_ref[c] = d_next
    decay = jnp.exp(totals_ref[c])
    d_totals_ref[c] = decay * jnp.sum(jnp.sum(d_next * entering_ref[c].astype(jnp.float32), axis=1), axis=0)
    return d_entering_ref[c] + decay * d_next

  d_initial_ref[...] = lax.fori_loop(0, num_chunks, step, d_final_ref[...])


def reverse_discumsum(
  d_entering: jax.Array,
  totals: jax.Array,
  entering: jax.Array,
  d_final: jax.Array,
  *,
  interpret: bool,
  num_warps: int = 4,
):
  """Backward of `discumsum`.

  With Shat_c the gradient of the state entering chunk c (Shat_n = the final state's):
  grad of dS_c = Shat_{c+1}, Shat_c = (direct gradient of S_c) + e^{total_c} Shat_{c+1},
  grad of total_c = e^{total_c} <Shat_{c+1}, S_c>.

  Args:
    d_entering: [BH, n, R, C] float32, the direct gradients of the entering states.
    totals: [BH, n] float32.
    entering: [BH, n, R, C], the entering states of the forward (any float dtype).
    d_final: [BH, R, C] float32, the gradient of the final state.

  Returns:
    gradients of the deltas [BH, n, R, C] float32, of the totals [BH, n] float32, and of
    the initial state [BH, R, C] float32.
  """
  bh, num_chunks, rows, cols = d_entering.shape
  slab = _slab_rows(rows, cols)
  slabs = rows // slab
  per_chunk, totals_spec, state = _specs(slab, cols, num_chunks)
  d_deltas, d_totals, d_initial = pl.pallas_call(
    _reverse_discumsum_kernel,
    grid=(bh, slabs),
    in_specs=[per_chunk, totals_spec, per_chunk, state],
    out_specs=[per_chunk, pl.BlockSpec((None, None, num_chunks), lambda b, r: (b, r, 0)), state],
    out_shape=[
      jax.ShapeDtypeStruct(d_entering.shape, jnp.float32),
      jax.ShapeDtypeStruct((bh, slabs, num_chunks), jnp.float32),
      jax.ShapeDtypeStruct(d_final.shape, jnp.float32),
    ],
    compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
    interpret=interpret,
    name="power_reverse_discumsum",
  )(d_entering, totals, entering, d_final)
  # Each slab holds its part of <Shat_{c+1}, S_c>.
  return d_deltas, jnp.sum(d_totals, axis=1), d_initial
