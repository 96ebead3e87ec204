"""The device mesh ("data", "fsdp", "tensor") built from `config.mesh`."""

from __future__ import annotations

from typing import Sequence

import jax

from castle_jax.sharding import MESH_AXES, mesh_of


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
  return mesh_of([mesh_config[a] for a in MESH_AXES], devices)


def data_parallel_size(mesh: jax.sharding.Mesh) -> int:
  """How many ways the batch dimension is split (data x fsdp)."""
  return mesh.shape["data"] * mesh.shape["fsdp"]
