"""State expansions phi with phi(q) . phi(k) = (q . k)^p (paper Sec. 4, Appendix B).

  tpow_p:  the flattened tensor power x^{(x)p}, dimension d^p (Lemma 4.1);
  spow_p:  one entry per non-decreasing multi-index i_1 <= ... <= i_p of [d], weighted by
           sqrt(p! / prod_k hist_k(i)!), dimension C(d + p - 1, p) (Lemma 4.2);
  tspow_p: the tiled symmetric power of Sec. 4.1.1. The d features are cut into
           d / d_tile tiles; for every non-decreasing multi-index (t_1 <= ... <= t_p) of
           tiles, phi holds the whole tensor product x_{t_1} (x) ... (x) x_{t_p} of those
           tiles (d_tile^p entries) weighted by sqrt(p! / prod_k hist_k(t)!), so
           D = C(d / d_tile + p - 1, p) * d_tile^p. d_tile = 1 is spow, d_tile = d is tpow.

Why the tspow weight is right: (q . k)^p = sum over all p-tuples of tiles of
prod_m (q_{t_m} . k_{t_m}), each term is symmetric in the tiles, and a sorted tile
tuple stands for p! / prod hist! orderings.

All three are one gather-and-multiply with a static table:
  phi(x)[a] = w[a] * prod_{m < p} x[idx[a, m]],   idx: int [D, p], w: [D],
built once per (d, p, expansion, d_tile) with numpy. The layout inside phi is an
implementation detail; only inner products between two expansions are meaningful.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

EXPANSIONS = ("spow", "tpow", "tspow")


def default_d_tile(head_dim: int, p: int) -> int:
  """The tile size the paper found best: 8 for p = 2, 4 for larger p; at most head_dim."""
  return min(head_dim, 8 if p == 2 else 4)


def validate_expansion(expansion, head_dim: int, p: int, d_tile) -> int | None:
  """Checks the expansion name and tile size; returns the tile size tspow uses (None otherwise).

  Raises:
    ValueError naming `expansion` or `d_tile` and the fix.
  """
  if expansion not in EXPANSIONS:
    raise ValueError(f"Unknown expansion {expansion!r}; choose one of {EXPANSIONS}")
  if expansion != "tspow":
    if d_tile is not None:
      raise ValueError(
        f"d_tile={d_tile!r} only applies to expansion='tspow', got expansion={expansion!r}; drop d_tile or use 'tspow'"
      )
    return None
  if d_tile is None:
    d_tile = default_d_tile(head_dim, p)
  if isinstance(d_tile, bool) or not isinstance(d_tile, numbers.Integral) or d_tile < 1:
    raise ValueError(f"d_tile must be an int >= 1, got {d_tile!r}")
  if head_dim % d_tile:
    raise ValueError(
      f"d_tile ({d_tile}) must divide the head dim ({head_dim}) for expansion='tspow'; pick a divisor of {head_dim}"
    )
  return int(d_tile)


def expanded_dim(head_dim: int, p: int, expansion: str = "spow", d_tile: int | None = None) -> int:
  """D, the expanded dimension (Table 3 for tpow/spow; Sec. 4.1.1 for tspow)."""
  if expansion == "tpow":
    return head_dim**p
  if expansion == "spow":
    return math.comb(head_dim + p - 1, p)
  d_tile = validate_expansion(expansion, head_dim, p, d_tile)
  return math.comb(head_dim // d_tile + p - 1, p) * d_tile**p


def _sorted_multi_indices(n: int, p: int) -> np.ndarray:
  """int32 [C(n + p - 1, p), p]: the non-decreasing multi-indices of [n], in lexicographic order."""
  rows = np.fromiter(
    itertools.chain.from_iterable(itertools.combinations_with_replacement(range(n), p)), dtype=np.int32
  )
  return rows.reshape(-1, p)


def _symmetry_weights(sorted_indices: np.ndarray) -> np.ndarray:
  """float64 [rows]: sqrt(p! / prod_k hist_k!) for sorted multi-indices.

  In a sorted row equal indices are adjacent; a run of length L contributes
  1 * 2 * ... * L = L! to prod hist!, so the product of the running run lengths is it.
  """
  p = sorted_indices.shape[1]
  run = np.ones(len(sorted_indices), np.float64)
  repeats = np.ones(len(sorted_indices), np.float64)
  for m in range(1, p):
    run = np.where(sorted_indices[:, m] == sorted_indices[:, m - 1], run + 1, 1.0)
    repeats *= run
  return np.sqrt(math.factorial(p) / repeats)


@functools.lru_cache(maxsize=64)
def expansion_table(
  head_dim: int, p: int, expansion: str = "spow", d_tile: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """The static table of an expansion: (idx int32 [D, p], w float64 [D]).

  phi(x)[a] = w[a] * prod_m x[idx[a, m]]. Cached; the arrays are read-only.
  """
  d_tile = validate_expansion(expansion, head_dim, p, d_tile)
  if expansion == "tpow":
    idx = np.indices((head_dim,) * p, dtype=np.int32).reshape(p, -1).T
    weights = np.ones(len(idx))
  elif expansion == "spow":
    idx = _sorted_multi_indices(head_dim, p)
    weights = _symmetry_weights(idx)
  else:
    tiles = _sorted_multi_indices(head_dim // d_tile, p)  # [L, p]
    within = np.indices((d_tile,) * p, dtype=np.int32).reshape(p, -1).T  # [d_tile^p, p]
    idx = (tiles[:, None, :] * d_tile + within[None, :, :]).reshape(-1, p)
    weights = np.repeat(_symmetry_weights(tiles), len(within))
  idx = np.ascontiguousarray(idx, np.int32)
  for array in (idx, weights):
    array.setflags(write=False)
  return idx, weights


def expand(x: jax.Array, p: int, expansion: str = "spow", d_tile: int | None = None) -> jax.Array:
  """phi(x) along the last axis.

  Args:
    x: [..., d].
    p: the power (any int >= 1; power attention uses even p).
    expansion: "spow", "tpow" or "tspow".
    d_tile: tile size for "tspow" (default `default_d_tile`).

  Returns:
    [..., D] in x's dtype, D = `expanded_dim(d, p, expansion, d_tile)`.
  """
  idx, weights = expansion_table(x.shape[-1], p, expansion, d_tile)
  # One [..., D] factor at a time: never a [..., D, p] intermediate.
  out = jnp.take(x, idx[:, 0], axis=-1)
  for m in range(1, p):
    out = out * jnp.take(x, idx[:, m], axis=-1)
  if expansion == "tpow":
    return out
  return out * jnp.asarray(weights, x.dtype)


def tpow(x: jax.Array, p: int) -> jax.Array:
  """tpow_p(x): [..., d] -> [..., d^p], the flattened tensor power (Eq. 8)."""
  return expand(x, p, "tpow")


def spow(x: jax.Array, p: int) -> jax.Array:
  """spow_p(x): [..., d] -> [..., C(d + p - 1, p)], the weighted symmetric power (Eq. 9)."""
  return expand(x, p, "spow")


def tspow(x: jax.Array, p: int, d_tile: int | None = None) -> jax.Array:
  """tspow_p(x): [..., d] -> [..., C(d / d_tile + p - 1, p) * d_tile^p], the tiled symmetric power."""
  return expand(x, p, "tspow", d_tile)


@functools.lru_cache(maxsize=64)
def _conversion_table(head_dim: int, p: int, source: tuple, target: tuple) -> tuple[np.ndarray, np.ndarray]:
  """(rows int32 [D_target], factors float64 [D_target]): target[i] = factors[i] * source[rows[i]]."""
  source_idx, source_w = expansion_table(head_dim, p, *source)
  target_idx, target_w = expansion_table(head_dim, p, *target)
  # Every expansion holds each sorted multi-index at least once; its entry is w * (the
  # symmetric tensor's entry), so one source row per multi-index serves every target row.
  row_of = {}
  for row, key in enumerate(map(tuple, np.sort(source_idx, axis=1))):
    row_of.setdefault(key, row)
  rows = np.asarray([row_of[key] for key in map(tuple, np.sort(target_idx, axis=1))], np.int32)
  return rows, target_w / source_w[rows]


def convert_expanded(
  x: jax.Array, head_dim: int, p: int, source: tuple[str, int | None], target: tuple[str, int | None]
) -> jax.Array:
  """Re-lays an expanded quantity (a state's D axis) from one expansion to another.

  Valid for anything linear in phi(k) (states S = sum phi(k) v^T, normalizers sum phi(k)),
  because every expansion's entry is a fixed weight times the same symmetric tensor entry.

  Args:
    x: [..., D_source, *trailing] with the expanded axis at `-1` (normalizer) or `-2` (state);
      pass states as [..., D, d_v] and normalizers as [..., D, 1].
    source, target: (expansion, d_tile) pairs as accepted by `expansion_table`.

  Returns:
    [..., D_target, *trailing] in x's dtype.
  """
  if source == target:
    return x
  rows, factors = _conversion_table(head_dim, p, tuple(source), tuple(target))
  return jnp.take(x, rows, axis=-2) * jnp.asarray(factors, x.dtype)[:, None]
