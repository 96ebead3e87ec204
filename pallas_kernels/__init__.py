"""Pallas GPU kernels of castle_jax (CASTLE, power attention, GCA, tree attention)."""
