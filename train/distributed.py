"""Joining a multi-process job (several hosts, or one process per GPU) with JAX's own runtime.

A job is N copies of `python -m train` with the same config and workdir; each
calls `jax.distributed.initialize` before touching a device, after which
`jax.devices()` lists every process's devices, the mesh spans them all and each
process reads its own shard of the documents (`jax.process_index()`).

When to join (`initialize_if_launched`), first match wins:
  - flags or environment variables name the job: `--coordinator_address=HOST:PORT
    --num_processes=N --process_id=I` or `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
    `JAX_PROCESS_ID` (flags win over variables);
  - a cluster scheduler that jax 0.11.2 detects by itself started more than one
    task: SLURM (`srun`: SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS,
    SLURM_PROCID, SLURM_LOCALID) or Open MPI (`mpirun`: OMPI_COMM_WORLD_SIZE,
    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK); jax then finds the
    coordinator, the process count and id, and gives each process the GPU of its
    local rank;
  - otherwise the run is a single process over the local devices.
On CPU the processes exchange collectives through gloo (jax's default
`jax_cpu_collectives_implementation`). `JAX_LOCAL_DEVICE_IDS=0,1` (read by jax)
restricts a process to some local GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Mapping

import jax

ENV_ADDRESS, ENV_COUNT, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI_VARS = ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


class DistributedInitError(RuntimeError):
  """The multi-process settings are incomplete or the job could not be joined."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """How to call `jax.distributed.initialize`: explicit values, or None ones that jax
  fills from the detected `cluster` ("slurm" | "ompi")."""

  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  cluster: str | None = None


def detected_cluster(env: Mapping[str, str]) -> str | None:
  """ "slurm" or "ompi" when that launcher started more than one task, else None."""
  if all(v in env for v in _SLURM_VARS) and int(env["SLURM_NTASKS"]) > 1:
    return "slurm"
  if all(v in env for v in _OMPI_VARS) and int(env["OMPI_COMM_WORLD_SIZE"]) > 1:
    return "ompi"
  return None


def _as_int(value, name: str) -> int | None:
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise DistributedInitError(f"{name} must be an integer, got {value!r}") from None


def job_spec(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  env: Mapping[str, str] | None = None,
) -> JobSpec | None:
  """The job this process belongs to, or None for a single-process run.

  Args:
    coordinator_address, num_processes, process_id: from flags (None: not given);
      each falls back to its environment variable (JAX_COORDINATOR_ADDRESS,
      JAX_NUM_PROCESSES, JAX_PROCESS_ID).
    env: the environment (default os.environ).

  Raises:
    DistributedInitError: some but not all of the three are set (outside a
      detected cluster), or the values are out of range; the message names the
      missing setting.
  """
  env = os.environ if env is None else env
  address = coordinator_address or env.get(ENV_ADDRESS) or None
  count = num_processes if num_processes is not None else _as_int(env.get(ENV_COUNT), ENV_COUNT)
  index = process_id if process_id is not None else _as_int(env.get(ENV_ID), ENV_ID)
  cluster = detected_cluster(env)
  given = {
    "--coordinator_address / " + ENV_ADDRESS: address,
    "--num_processes / " + ENV_COUNT: count,
    "--process_id / " + ENV_ID: index,
  }
  if cluster is not None:  # jax fills whatever is not given
    return JobSpec(address, count, index, cluster)
  if all(v is None for v in given.values()):
    return None
  if count == 1 and index in (None, 0):
    return None  # a job of one process needs no coordinator
  missing = [name for name, v in given.items() if v is None]
  if missing:
    raise DistributedInitError(
      f"A multi-process job needs all three of coordinator address, process count and process id; "
      f"missing: {', '.join(missing)}. Give every process the same address (HOST:PORT of process 0) and "
      "count, and its own id 0..N-1."
    )
  if count < 1 or not 0 <= index < count:
    raise DistributedInitError(
      f"process id {index} is outside [0, {count}) (--process_id / {ENV_ID}, --num_processes / {ENV_COUNT})"
    )
  if ":" not in address:
    raise DistributedInitError(
      f"coordinator address {address!r} needs a port: HOST:PORT (--coordinator_address / {ENV_ADDRESS})"
    )
  return JobSpec(address, count, index)


def initialize_if_launched(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  initialization_timeout: int = 300,
) -> JobSpec | None:
  """Calls `jax.distributed.initialize` when this process is one of a multi-process
  job (see the module docstring); must run before anything touches a device.

  Returns:
    The job joined, or None for a single-process run.

  Raises:
    DistributedInitError: incomplete settings, or the coordinator could not be
      reached within `initialization_timeout` seconds (the message says which
      address and what to check).
  """
  spec = job_spec(coordinator_address, num_processes, process_id)
  if spec is None:
    return None
  where = (
    f"as process {spec.process_id} of {spec.num_processes} with coordinator {spec.coordinator_address}"
    if spec.cluster is None
    else f"through {spec.cluster}"
  )
  if spec.cluster is None and spec.process_id != 0:
    # jaxlib aborts the process (no Python exception) when the coordinator never answers.
    wait_for_coordinator(spec.coordinator_address, initialization_timeout, where)
  try:
    jax.distributed.initialize(
      coordinator_address=spec.coordinator_address,
      num_processes=spec.num_processes,
      process_id=spec.process_id,
      initialization_timeout=initialization_timeout,
    )
  except Exception as e:  # noqa: BLE001 - jaxlib raises XlaRuntimeError/RuntimeError/ValueError
    text = " ".join(str(e).split())[:400]
    raise DistributedInitError(
      f"Could not join the multi-process job {where}: {type(e).__name__}: {text}. Check that every process was "
      "started with the same address and process count, that process 0 is running and that its port is "
      "reachable from this host."
    ) from e
  return spec


def wait_for_coordinator(address: str, timeout_s: float, where: str = "") -> None:
  """Waits until process 0's coordinator accepts TCP connections at HOST:PORT.

  Raises:
    DistributedInitError: nothing listens there within `timeout_s` seconds.
  """
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port)), timeout=max(1.0, min(5.0, timeout_s))):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise DistributedInitError(
          f"Could not join the multi-process job {where}: nothing answers at {address} after {timeout_s:g} s "
          f"({e}). Start process 0 (it hosts the coordinator) with the same --coordinator_address, check the "
          "host name and that the port is open, or raise --coordinator_timeout_s."
        ) from None
      time.sleep(0.5)
