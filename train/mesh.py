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
      f"Mesh {names} uses {math.prod(shape)} devices but {num_devices} are available; set one axis to -1 to fill"
    )
  return shape


def select_devices(num_devices: int) -> list[jax.Device]:
  """Every device of the job (-1) or the first `num_devices` (`mesh.num_devices`, one process only)."""
  devices = jax.devices()
  if num_devices == -1:
    return devices
  if not 1 <= num_devices <= len(devices):
    raise ValueError(f"mesh.num_devices={num_devices} must be -1 (all) or in 1..{len(devices)} (the devices available)")
  if jax.process_count() > 1 and num_devices != len(devices):
    raise ValueError(
      f"mesh.num_devices={num_devices} cannot leave devices out of a job of {jax.process_count()} "
      "processes (every process must hold part of the mesh); use -1"
    )
  return devices[:num_devices]


def make_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A mesh shaped by mesh_config.{data,fsdp,tensor} over `devices` (default: those
  `mesh_config.num_devices` selects, all when it is absent or -1)."""
  if devices is None:
    devices = select_devices(mesh_config.get("num_devices", -1))
  devices = list(devices)
  shape = resolve_mesh_shape([mesh_config[a] for a in MESH_AXES], len(devices))
  return jax.make_mesh(
    shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES), devices=np.asarray(devices).reshape(-1)
  )


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  """How many ways the batch dimension is split (data x fsdp)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]
