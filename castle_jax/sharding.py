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

import contextlib
import math
from typing import Callable, Iterator, Sequence

import flax.linen as nn
import jax
import numpy as np

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

# Logical layouts of per-head activations as attention ops take them.
SEQUENCE_HEADS_AXES = ("batch", None, "act_heads", None)  # [batch, seq, heads, head_dim]
KV_SEQUENCE_HEADS_AXES = ("batch", None, "act_kv_heads", None)  # the same with key/value heads
TOKEN_HEADS_AXES = ("batch", "act_heads", None)  # [batch, heads, head_dim]


def resolve_mesh_shape(sizes: Sequence[int], num_devices: int) -> tuple[int, ...]:
  """Fills at most one -1 entry so the product equals num_devices.

  Args:
    sizes: requested (data, fsdp, tensor) sizes; each >= 1 or -1.
    num_devices: devices available.
  """
  names = ", ".join(f"mesh.{a}={s}" for a, s in zip(MESH_AXES, sizes))
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"Mesh sizes must be >= 1 or -1 (fill); got {names}")
  if sum(s == -1 for s in sizes) > 1:
    raise ValueError(f"At most one mesh axis may be -1 (fill); got {names}")
  known = math.prod(s for s in sizes if s != -1)
  if num_devices % known:
    raise ValueError(f"Mesh {names} does not divide the {num_devices} available devices")
  shape = tuple(num_devices // known if s == -1 else s for s in sizes)
  if math.prod(shape) != num_devices:
    raise ValueError(
      f"Mesh {names} uses {math.prod(shape)} devices but {num_devices} are available; set one axis to -1 to fill"
    )
  return shape


def mesh_of(sizes: Sequence[int], devices: Sequence[jax.Device]) -> jax.sharding.Mesh:
  """The ("data", "fsdp", "tensor") mesh of `sizes` (`resolve_mesh_shape`) over `devices`."""
  devices = list(devices)
  shape = resolve_mesh_shape(sizes, len(devices))
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=np.asarray(devices).reshape(-1)
  )


@contextlib.contextmanager
def on_mesh(mesh: jax.sharding.Mesh | None) -> Iterator[None]:
  """Runs the body with `mesh` set (`jax.set_mesh`) and LOGICAL_AXIS_RULES in force, so that
  the model's logical constraints and `map_over_shards` shard over it; None: nothing set."""
  if mesh is None:
    yield
    return
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    yield


def with_axes(init: Callable, axes: Sequence[str | None]) -> Callable:
  """Wraps a parameter initializer so the parameter carries logical axis names."""
  return nn.with_logical_partitioning(init, tuple(axes))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation's sharding by logical names (a no-op outside a mesh context)."""
  return nn.with_logical_constraint(x, tuple(axes))


def _mesh_axes(logical: str | None, mesh) -> tuple[str, ...]:
  """The mesh axes (of size > 1) that LOGICAL_AXIS_RULES maps a logical axis onto."""
  if logical is None:
    return ()
  target = dict(LOGICAL_AXIS_RULES)[logical]
  axes = (target,) if isinstance(target, str) else tuple(target or ())
  return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def check_divisible(shape: Sequence[int], mesh_axes: Sequence[tuple[str, ...]], mesh, what: str, fix: str) -> None:
  """Raises ValueError unless every dimension divides over the mesh axes it is split over.

  Args:
    shape: the array's shape.
    mesh_axes: per dimension, the mesh axes it is split over (() for none).
    mesh: the (abstract) mesh.
    what: the array's name in the message (e.g. "Parameter ['params']['embed']").
    fix: what to change, appended to the message.
  """
  for dim, (size, axes) in enumerate(zip(shape, mesh_axes)):
    ways = math.prod(mesh.shape[axis] for axis in axes)
    if size % ways:
      raise ValueError(
        f"{what} cannot be sharded: shape {tuple(shape)}, dimension {dim} is split over mesh axes "
        f"{tuple(axes)} ({ways} ways) and must be a multiple of {ways}. {fix}"
      )


def check_params_divisible(abstract, fix: str, what: str = "Parameter") -> None:
  """`check_divisible` for every leaf of `abstract` (ShapeDtypeStructs with NamedShardings):
  a ValueError naming the first parameter (`what` and its path) that does not divide over the
  mesh axes its sharding splits it over, and `fix`."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
    axes = [(axis,) if isinstance(axis, str) else tuple(axis or ()) for axis in leaf.sharding.spec]
    check_divisible(leaf.shape, axes, leaf.sharding.mesh, f"{what} {jax.tree_util.keystr(path)}", fix)


def map_over_shards(fn: Callable, args: Sequence, in_axes: Sequence, out_axes, *, what: str):
  """fn(*args), run on every device's shard when a device mesh is set (`jax.set_mesh`).

  Pallas kernels are custom calls for which XLA's partitioner has no rule: under a mesh
  it would have to gather their operands and run the whole batch on every device. Ops that are
  independent per batch row and head run through `jax.shard_map` instead, each
  device on its own rows and heads. Without a mesh (or a mesh of one device) this is
  fn(*args).

  Args:
    fn: the per-shard computation (it sees shard shapes).
    args: arrays (or pytrees of arrays with one layout each).
    in_axes: per arg, the logical axis name per dimension ("batch", "act_heads" or
      None, see LOGICAL_AXIS_RULES), or None for an arg every device holds whole.
    out_axes: the same for fn's output, or a list of them for several outputs.
    what: the op's name, for error messages.

  Raises:
    ValueError: a dimension that does not divide over its mesh axes (naming the op,
      the argument and the fix).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return fn(*args)

  def spec(names):
    if names is None:
      return jax.sharding.PartitionSpec()
    return jax.sharding.PartitionSpec(*(_mesh_axes(n, mesh) or None for n in names))

  if not any(_mesh_axes(name, mesh) for names in in_axes for name in (names or ())):
    return fn(*args)
  for index, (arg, names) in enumerate(zip(args, in_axes)):
    for leaf in jax.tree.leaves(arg):
      check_divisible(
        leaf.shape,
        [_mesh_axes(name, mesh) for name in names or ()],
        mesh,
        f"{what}: argument {index}",
        "Change the batch size / head count or the mesh",
      )
  in_specs = tuple(spec(names) for names in in_axes)
  out_specs = tuple(spec(names) for names in out_axes) if isinstance(out_axes, list) else spec(out_axes)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
