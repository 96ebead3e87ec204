"""Identical Mosaic GPU kernels hash alike, so jaxlib compiles them once per process
(`pallas_kernels.mosaic_kernel_cache`). Checked on the program lowered for an H100 on
CPU: the kernel hash is what jaxlib's compile cache is keyed by."""

import re

import jax.numpy as jnp

from helpers import lowered_for_h100
from pallas_kernels import mosaic_kernel_cache
from pallas_kernels.castle.mosaic_attention import castle_attention_mosaic


def _kernel_hashes(f, inputs) -> list[str]:
  return re.findall(r'kernel_hash = "([^"]*)"', lowered_for_h100(f, inputs))


def test_layers_of_identical_kernels_share_one_hash_each():
  inputs = tuple(jnp.full((1, 128, 1, 64), 0.1 * (i + 1), jnp.bfloat16) for i in range(6))
  attention = lambda *a: castle_attention_mosaic(*a, window=64, interpret=False)

  def two_layers(*a):
    first = attention(*a)
    return attention(first, *a[1:])

  one, two = _kernel_hashes(attention, inputs), _kernel_hashes(two_layers, inputs)
  assert len(two) == 2 * len(one) > 0
  # Within a layer too: the overflow rerun's call sites run the first call's kernels.
  assert len(set(one)) == len(one) // 2
  # Without the shared basename every call site has its own hash: 2 * len(one) distinct.
  assert set(two) == set(one), "a second layer added kernel hashes of its own"


def test_steps_aside_for_dumps(monkeypatch):
  assert mosaic_kernel_cache.share_identical_kernels(), "importing pallas_kernels shares kernels"
  monkeypatch.setenv("MOSAIC_GPU_DUMP_PTX", "1")
  assert mosaic_kernel_cache.dumps_requested()
  monkeypatch.delenv("MOSAIC_GPU_DUMP_PTX")
  assert not mosaic_kernel_cache.dumps_requested()
