"""The batched tile algebra of `benchmarks/castle_window_tiles_xla.py` (CASTLE-SWL's window
tiles without a serial lookahead state) against the definitions: outputs, final
lookahead keys and gradients, on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle.reference import castle_parallel, lookahead_keys
from benchmarks import castle_window_tiles_xla


def _inputs(length, head_dim=16, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=(1, length, 1, head_dim)), jnp.float32) for _ in range(6))


def _attention_from_tiles(*inputs, window):
  heads = [x[:, :, 0] for x in inputs]
  length = heads[0].shape[1]
  acc, sums, keys = castle_window_tiles_xla.window_tiles(
    *heads, jnp.zeros((1, length)), window=window, diagonals=length // castle_window_tiles_xla.TILE, dtype=jnp.float32
  )
  return (acc / sums[..., None])[:, :, None], keys[:, :, None]


@pytest.mark.parametrize("length,window", [(256, 512), (384, 100), (256, 64), (192, 1)])
def test_tiles_match_the_parallel_form(length, window):
  inputs = _inputs(length)
  out, keys = _attention_from_tiles(*inputs, window=window)
  np.testing.assert_allclose(out, castle_parallel(*inputs, window=window), atol=2e-5)
  np.testing.assert_allclose(keys, lookahead_keys(*inputs[:3], length, window=window), atol=2e-5)


def test_tile_gradients_match_the_parallel_form():
  inputs = _inputs(192, seed=1)
  cotangent = jnp.asarray(np.random.default_rng(2).normal(size=inputs[0].shape), jnp.float32)
  grads = [
    jax.grad(lambda *x: jnp.sum(f(*x) * cotangent), argnums=tuple(range(6)))(*inputs)
    for f in (lambda *x: _attention_from_tiles(*x, window=100)[0], lambda *x: castle_parallel(*x, window=100))
  ]
  for ours, want in zip(*grads):
    np.testing.assert_allclose(ours, want, atol=1e-4)


def test_window_part_only_covers_the_window():
  # With the window's diagonals only, the tiles past them (t - s > W + 63) add nothing.
  inputs = [x[:, :, 0] for x in _inputs(512)]
  shift = jnp.zeros((1, 512))
  window_only = castle_window_tiles_xla.window_tiles(*inputs, shift, window=100, diagonals=3, dtype=jnp.float32)
  every_pair = castle_window_tiles_xla.window_tiles(*inputs, shift, window=100, diagonals=8, dtype=jnp.float32)
  np.testing.assert_allclose(window_only[2], every_pair[2], atol=1e-5)  # the same final keys
  assert np.all(np.asarray(window_only[1]) <= np.asarray(every_pair[1]) + 1e-5)
  assert not np.allclose(window_only[1][:, 256:], every_pair[1][:, 256:])


def test_bad_sizes_raise():
  x = jnp.zeros((1, 100, 16))
  with pytest.raises(ValueError, match="multiple of 64"):
    castle_window_tiles_xla.window_tiles(x, x, x, x, x, x, jnp.zeros((1, 100)), window=8, diagonals=2)
