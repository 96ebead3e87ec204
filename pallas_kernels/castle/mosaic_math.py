"""The sigmoid and SiLU of the Mosaic GPU CASTLE kernels, in instructions Hopper runs fast.

Every (query, key) pair of a CASTLE kernel takes a SiLU (and in the backward its
derivative), so the sigmoid sits in the elementwise work that the tensor cores wait on.
`1 / (1 + e^-x)` lowers to an IEEE division in Mosaic GPU (`arith.divf`: a reciprocal,
Newton steps and a range check per element, even with `approx_math`). Here the
reciprocal is the square of a reciprocal square root, `rsqrt(1 + e^-x)^2`: with
`approx_math` (`pallas_kernels.mosaic_compiler_params`) that is `rsqrt.approx.f32`, one MUFU
instruction with ~2^-22 relative error, and one multiply. 1 + e^-x >= 1, so the root
is always defined; where e^-x overflows to inf, the root is 0 and so is the sigmoid.
The Triton kernels keep `pallas_kernels.castle.triton_kernels.sigmoid` (Triton lowers the
division to a fast one already).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp


def sigmoid(x: jax.Array) -> jax.Array:
  root = lax.rsqrt(1.0 + jnp.exp(-x))
  return root * root


def silu(x: jax.Array) -> jax.Array:
  return x * sigmoid(x)


def silu_grad(x: jax.Array) -> jax.Array:
  """d SiLU(x) / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))."""
  sig = sigmoid(x)
  return sig * (1.0 + x * (1.0 - sig))


def silu_and_grad(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(SiLU(x), SiLU'(x)) from one sigmoid."""
  sig = sigmoid(x)
  silu_x = x * sig
  return silu_x, sig + silu_x * (1.0 - sig)
