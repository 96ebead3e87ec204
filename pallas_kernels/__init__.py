"""Pallas GPU kernels of castle_jax (CASTLE, power attention, GCA, tree attention)."""

from pallas_kernels.mosaic_kernel_cache import share_identical_kernels

# Identical Mosaic GPU kernels (one per layer of a model) compile once per process.
share_identical_kernels()
