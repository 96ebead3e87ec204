"""RMSNorm (Zhang & Sennrich, 2019) and LayerNorm (Ba et al., 2016), computed in float32."""

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


class LayerNorm(nn.Module):
  """(x - mean(x)) / std(x) * scale + bias over the last axis; statistics in float32.

  Attributes:
    eps: added to the variance before the square root.
    dtype: output dtype.
    param_dtype: dtype of the learned scale and bias (shape [features] each).
  """

  eps: float = 1e-5
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    features = (x.shape[-1],)
    scale = self.param("scale", with_axes(nn.initializers.ones, ("norm",)), features, self.param_dtype)
    bias = self.param("bias", with_axes(nn.initializers.zeros, ("norm",)), features, self.param_dtype)
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    x32 = centered * jax.lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True) + self.eps)
    return (x32 * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)
