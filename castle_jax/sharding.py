"""Logical axis names and the one table that maps them onto the device mesh.

Every parameter and activation in the library names its axes logically
("embed", "heads", ...). This table decides how those names map onto the mesh
axes ("data", "fsdp", "tensor"):
  - data: pure data parallelism (parameters replicated);
  - fsdp: data parallelism with parameters and optimizer state sharded (ZeRO-3);
  - tensor: Megatron-style tensor parallelism over heads, MLP width and vocabulary.
Parameter axes and activation axes have different names ("embed" vs "act_embed")
because a parameter's embed axis is sharded over fsdp while activations keep it whole.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)


def with_axes(init: Callable, axes: Sequence[str | None]) -> Callable:
  """Wraps a parameter initializer so the parameter carries logical axis names."""
  return nn.with_logical_partitioning(init, tuple(axes))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation's sharding by logical names (a no-op outside a mesh context)."""
  return nn.with_logical_constraint(x, tuple(axes))
