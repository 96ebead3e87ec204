"""SwiGLU feed-forward block (Shazeer, 2020): (silu(x W1) * (x W2)) W3."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.sharding import constrain, with_axes


class SwiGLU(nn.Module):
  """Gated feed-forward block.

  Attributes:
    hidden: width of the gated hidden layer (8/3 * d_model in the CASTLE paper).
    init_std: std of the input projections.
    out_init_std: std of the output projection (scaled down with depth).
  """

  hidden: int
  init_std: float = 0.02
  out_init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [batch, seq, d_model] -> [batch, seq, d_model]."""
    d_model = x.shape[-1]

    def dense(name, features, axes, std):
      return nn.Dense(
        features,
        use_bias=False,
        name=name,
        dtype=self.dtype,
        param_dtype=self.param_dtype,
        kernel_init=with_axes(nn.initializers.normal(std), axes),
      )

    gate = dense("w_gate", self.hidden, ("embed", "mlp"), self.init_std)(x)
    up = dense("w_up", self.hidden, ("embed", "mlp"), self.init_std)(x)
    h = constrain(nn.silu(gate) * up, ("batch", "act_length", "act_mlp"))
    return dense("w_down", d_model, ("mlp", "embed"), self.out_init_std)(h)
