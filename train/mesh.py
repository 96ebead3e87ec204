"""The device mesh ("data", "fsdp", "tensor") built from `config.mesh`."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from castle_jax.sharding import MESH_AXES


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
        f"Mesh {names} uses {math.prod(shape)} devices but {num_devices} are available; "
        "set one axis to -1 to fill")
  return shape


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A mesh over `devices` (default: all) shaped by mesh_config.{data,fsdp,tensor}."""
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape([mesh_config[a] for a in MESH_AXES], len(devices))
  return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES),
                       devices=np.asarray(devices).reshape(-1))


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  """How many ways the batch dimension is split (data x fsdp)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]
