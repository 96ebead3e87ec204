"""Orbax checkpoints of the train state together with the grain iterator state."""

from __future__ import annotations

import os
from typing import Any

import grain
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves (asynchronously) and restores {state, data_iter} under `directory`.

  Orbax writes each step into a temporary directory and renames it when complete,
  so an interrupted save never replaces the last good checkpoint.
  """

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    if keep < 1:
      raise ValueError(f"train.keep_checkpoints must be >= 1, got {keep}")
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=async_save))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, state: Any, data_iterator: Any | None = None) -> None:
    items = {"state": ocp.args.StandardSave(state)}
    if data_iterator is not None:
      items["data_iter"] = grain.checkpoint.CheckpointSave(data_iterator)
    self._manager.save(step, args=ocp.args.Composite(**items))

  def restore(self, step: int, abstract_state: Any, data_iterator: Any | None = None) -> Any:
    """Restores the state into the shardings of `abstract_state`; restores the
    data iterator in place when one is given."""
    items = {"state": ocp.args.StandardRestore(abstract_state)}
    if data_iterator is not None:
      items["data_iter"] = grain.checkpoint.CheckpointRestore(data_iterator)
    return self._manager.restore(step, args=ocp.args.Composite(**items))["state"]

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
