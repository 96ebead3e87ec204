"""SIGINT (Ctrl-C) and SIGTERM (cluster schedulers) end a run cleanly, within a step.

While `StopSignals` is active the first SIGINT/SIGTERM only records a request. The loop
keeps at most two steps on the device (the one running and the next one queued), so the
request is seen within about a step, whatever `train.log_every` is; the loop then saves a
checkpoint of the step in flight and raises `TrainingInterrupted`, which `python -m train`
turns into exit status 130 (SIGINT) or 143 (SIGTERM), i.e. 128 + the signal number, as a
shell reports a process killed by that signal. An evaluation under way when the signal comes
is abandoned: the checkpoint comes first. A second SIGINT aborts at once (KeyboardInterrupt).

One stop may arrive twice: `timeout` sends its signal to the process and then to the process
group, which holds the process too. Another signal within `REPEAT_S` of the first is taken as
that repeat and ignored, as is any later SIGTERM; so the request is announced once, and a
SIGINT sent that way does not abort.

With several processes a signal may reach only some of them, and they must stop at the
same step (the checkpoint save is collective). `StopVote` takes every process's request
to a tiny all-reduce dispatched just before each step: it runs on the device after the
previous step, so its result is on the host by the time the loop has waited for that step,
and every process reads the same value at the same step without stalling the device.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np


class TrainingInterrupted(Exception):
  """The run stopped on a signal after saving a checkpoint of `step`.

  `signaled_during`: the step that was running when this process got the signal (None when
  the signal reached another process of the job). `abandoned_eval`: the evaluation of `step`
  was under way and was given up for the checkpoint (it has no eval record)."""

  def __init__(
    self,
    signum: int,
    step: int,
    checkpoint_dir: str,
    signaled_during: int | None = None,
    abandoned_eval: bool = False,
  ):
    self.signum = signum
    self.step = step
    self.signaled_during = signaled_during
    self.abandoned_eval = abandoned_eval
    self.exit_code = 128 + signum
    name = signal.Signals(signum).name
    cause = (
      f" (the signal came during step {signaled_during}"
      if signaled_during is not None
      else " (sent to another process of the job"
    )
    cause += "; its evaluation was abandoned)" if abandoned_eval else ")"
    super().__init__(
      f"Stopped by {name} after step {step}{cause}; saved checkpoint {checkpoint_dir}. "
      "Re-run the same command to resume."
    )


class StopSignals:
  """Context manager: `requested` is the signal number received, or None.

  The loop sets `finished_step` (the newest step known to have finished on the device), so
  that `signaled_during` names the step the signal interrupted."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)
  REPEAT_S = 1.0  # a signal this soon after the first is the same stop, delivered twice

  def __init__(self):
    self.requested: int | None = None
    self.finished_step = 0
    self.signaled_during: int | None = None
    self._requested_at = 0.0
    self._previous = {}
    self._active = False

  def _handle(self, signum, frame):
    del frame
    if self.requested is not None:
      if signum == signal.SIGINT and time.monotonic() - self._requested_at >= self.REPEAT_S:
        raise KeyboardInterrupt  # second Ctrl-C: stop without waiting for the checkpoint
      return  # the same stop again (to the process, then to its group), or a later SIGTERM
    self._requested_at = time.monotonic()
    self.requested = signum
    self.signaled_during = self.finished_step + 1
    # os.write, not print: the handler may interrupt a print to the same stream.
    os.write(
      2,
      f"\n{signal.Signals(signum).name} received during step {self.signaled_during}: saving a checkpoint of "
      "the step in flight (Ctrl-C again to abort without saving)\n".encode(),
    )

  def __enter__(self):
    # Handlers can only be installed from the main thread (notebooks may run elsewhere).
    self._active = threading.current_thread() is threading.main_thread()
    if self._active:
      for s in self.SIGNALS:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    if self._active:
      for s, handler in self._previous.items():
        signal.signal(s, handler)
    return False


class StopVote:
  """The largest stop request (signal number, 0: none) of all the job's processes.

  `cast(requested)` dispatches the all-reduce of this process's request (call it just
  before dispatching a step, in the same order on every process); `result(vote)` reads it,
  after the loop has waited for the previous step."""

  def __init__(self, mesh: jax.sharding.Mesh):
    devices = np.asarray(mesh.devices).reshape(-1)
    flat = jax.sharding.Mesh(devices, ("all",))
    self._sharding = jax.sharding.NamedSharding(flat, jax.sharding.PartitionSpec("all"))
    self._local = [d for d in devices if d.process_index == jax.process_index()]
    self._count = devices.size
    self._reduce = jax.jit(jnp.max, out_shardings=jax.sharding.NamedSharding(flat, jax.sharding.PartitionSpec()))

  def cast(self, requested: int | None) -> jax.Array:
    value = np.full((1,), requested or 0, np.int32)
    shards = [jax.device_put(value, device) for device in self._local]
    return self._reduce(jax.make_array_from_single_device_arrays((self._count,), self._sharding, shards))

  @staticmethod
  def result(vote: jax.Array) -> int | None:
    return int(np.asarray(vote.addressable_data(0))) or None
