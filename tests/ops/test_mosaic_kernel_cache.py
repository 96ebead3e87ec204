"""A model's layers of Mosaic GPU kernels are lowered and compiled once, not per layer.

Two mechanisms, both checked on the program lowered for an H100 on CPU:
- the op's forward and backward are jitted (`pallas_kernels.castle.mosaic`), so
  every layer that calls them with equal shapes calls one lowered function;
- identical kernels hash alike (`pallas_kernels.mosaic_kernel_cache`), so jaxlib, whose
  compile cache is keyed by the kernel hash, compiles the kernels that several lowered
  functions share (the forward inside and outside a rematerialized block, the overflow
  rerun) once per process. That patches a private jax function, which the Mosaic ops do
  when called, never an import.
"""

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from helpers import lowered_for_h100
from pallas_kernels import mosaic_kernel_cache
from pallas_kernels.castle.mosaic import castle_attention_mosaic
from pallas_kernels.gca.mosaic import gca_attention_mosaic

_INPUTS = tuple(jnp.full((1, 128, 1, 64), 0.1 * (i + 1), jnp.bfloat16) for i in range(6))


def _attention(*a):
  return castle_attention_mosaic(*a, window=64, interpret=False)


def _kernel_hashes(f, inputs=_INPUTS) -> list[str]:
  return re.findall(r'kernel_hash = "([^"]*)"', lowered_for_h100(f, inputs))


def _gradient_of_layers(layers: int, attention=_attention, num_inputs: int = 6):
  """The gradient of `layers` rematerialized calls of attention(x, *rest), each feeding the next its x."""

  def loss(x, *rest):
    for _ in range(layers):
      x = jax.checkpoint(attention)(x, *rest)
    return jnp.sum(x.astype(jnp.float32))

  return jax.grad(loss, argnums=tuple(range(num_inputs)))


@functools.cache
def _hashes_of_layers(layers: int) -> tuple[str, ...]:
  """The kernel hashes of `_gradient_of_layers(layers)`, lowered once per process: the two
  tests below share the three-layer program (they run in one process, by their group)."""
  return tuple(_kernel_hashes(_gradient_of_layers(layers)))


@pytest.mark.xdist_group("mosaic_kernel_cache_layers")
def test_identical_kernels_share_one_hash():
  one = _kernel_hashes(_attention)
  assert len(one) > 0
  # The overflow rerun's call sites run the first call's kernels.
  assert len(set(one)) == len(one) // 2
  gradient = _hashes_of_layers(3)
  # The forward appears in several lowered functions (primal, residuals, recomputed):
  # each kernel hashes alike wherever it appears. Without the shared basename every
  # call site has a hash of its own.
  assert len(gradient) > len(set(gradient))
  assert set(one) <= set(gradient)


@pytest.mark.xdist_group("mosaic_kernel_cache_layers")
def test_layers_lower_the_kernels_once():
  # Without the jitted forward and backward, each layer adds its own call sites. (Two
  # layers have fewer: the first and the last layer's calls differ from the others'.)
  three, six = (_hashes_of_layers(n) for n in (3, 6))
  assert len(six) == len(three)
  assert set(six) == set(three)


def test_gca_layers_lower_the_kernels_once():
  chunk_k = chunk_v = jnp.full((1, 4, 64, 1, 64), 0.1, jnp.bfloat16)
  weights = jnp.full((1, 2, 2), 0.5, jnp.float32)
  indices = jnp.array([[[0, 1], [1, 2]]], jnp.int32)

  q = jnp.full((1, 128, 1, 64), 0.1, jnp.bfloat16)
  attention = lambda q, *a: gca_attention_mosaic(q, *a, indices, scale=0.125)
  three, six = (
    _kernel_hashes(_gradient_of_layers(n, attention, num_inputs=4), (q, chunk_k, chunk_v, weights)) for n in (3, 6)
  )
  assert 0 < len(six) == len(three)


def test_importing_the_kernels_patches_nothing():
  code = (
    "import pallas_kernels.castle, pallas_kernels.gca\n"
    "from jax._src.lib import mosaic_gpu_dialect as dialect\n"
    "print(getattr(dialect.get_or_set_dump_options, 'shares_identical_kernels', False))"
  )
  run = subprocess.run(
    [sys.executable, "-c", code], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert run.stdout.strip() == "False"


def test_steps_aside_for_dumps(monkeypatch):
  _kernel_hashes(_attention)
  assert mosaic_kernel_cache.share_identical_kernels(), "a Mosaic op shares kernels"
  monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
  assert mosaic_kernel_cache.dumps_requested()
  monkeypatch.delenv("MOSAIC_GPU_DUMP_PTX")
  assert not mosaic_kernel_cache.dumps_requested()
