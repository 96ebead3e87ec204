"""RMSNorm (Zhang & Sennrich, 2019), computed in float32."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.sharding import with_axes


class RMSNorm(nn.Module):
  """x / rms(x) * scale over the last axis; statistics in float32.

  Attributes:
    eps: added to the mean square before the square root.
    dtype: output dtype.
    param_dtype: dtype of the learned scale (shape [features]).
  """

  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", with_axes(nn.initializers.ones, ("norm",)), (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (x32 * scale.astype(jnp.float32)).astype(self.dtype)
