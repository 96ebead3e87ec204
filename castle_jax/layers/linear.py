"""A linear map over several axes (bias-free by default) whose kernel carries logical axis names.

Flax's DenseGeneral initializes a flattened 2-D kernel and reshapes it, which does
not fit a 3-D logical sharding annotation; this creates the kernel in its real shape.
"""

from __future__ import annotations

import math
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.sharding import with_axes


class Linear(nn.Module):
  """y = tensordot(x, kernel) (+ bias) over the last `contract_dims` axes of x.

  Attributes:
    features: output shape appended to x's leading axes, e.g. (heads, head_dim).
    axes: logical names of the kernel axes, [*contracted input axes, *features].
    contract_dims: number of trailing input axes contracted.
    init_std: std of the normal initializer.
    use_bias: add a bias of shape `features` (zeros at init; its axes are the features' names).
  """

  features: Sequence[int]
  axes: Sequence[str | None]
  contract_dims: int = 1
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  use_bias: bool = False

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape = (*x.shape[x.ndim - self.contract_dims :], *self.features)
    if len(self.axes) != len(shape):
      raise ValueError(f"Linear {self.name}: {len(self.axes)} axis names {self.axes} for a kernel of shape {shape}")
    kernel = self.param("kernel", with_axes(nn.initializers.normal(self.init_std), self.axes), shape, self.param_dtype)
    x = x.astype(self.dtype)
    leading = x.shape[: x.ndim - self.contract_dims]
    if math.prod(leading) == 1:
      # One token (batch-1 decoding): XLA's GPU compiler rewrites a vector-matrix product with a
      # small matrix into an elementwise multiply, which writes the whole product, and a reduction
      # that reads it back; a product of two equal rows stays a matrix product.
      contracted = x.shape[len(leading) :]
      rows = jnp.broadcast_to(x.reshape(1, *contracted), (2, *contracted))
      y = jnp.tensordot(rows, kernel.astype(self.dtype), axes=self.contract_dims)[0].reshape(*leading, *self.features)
    else:
      y = jnp.tensordot(x, kernel.astype(self.dtype), axes=self.contract_dims)
    if self.use_bias:
      bias_axes = tuple(self.axes[self.contract_dims :])
      bias = self.param("bias", with_axes(nn.initializers.zeros, bias_axes), tuple(self.features), self.param_dtype)
      y = y + bias.astype(self.dtype)
    return y
