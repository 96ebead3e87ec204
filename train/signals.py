"""SIGINT (Ctrl-C) and SIGTERM (cluster schedulers) end a run cleanly.

While `StopSignals` is active the first SIGINT/SIGTERM only records a request;
the loop finishes the step it is in, saves a checkpoint of it and raises
`TrainingInterrupted`, which `python -m train` turns into exit status 130
(SIGINT) or 143 (SIGTERM), i.e. 128 + the signal number, as a shell reports a
process killed by that signal. A second SIGINT aborts at once (KeyboardInterrupt).
"""

from __future__ import annotations

import os
import signal
import threading


class TrainingInterrupted(Exception):
  """The run stopped on a signal after saving a checkpoint of `step`."""

  def __init__(self, signum: int, step: int, checkpoint_dir: str):
    self.signum = signum
    self.step = step
    self.exit_code = 128 + signum
    name = signal.Signals(signum).name
    super().__init__(
      f"Stopped by {name} after step {step}; checkpoint saved in {checkpoint_dir}. Re-run the same command to resume."
    )


class StopSignals:
  """Context manager: `requested` is the signal number received, or None."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.requested: int | None = None
    self._previous = {}
    self._active = False

  def _handle(self, signum, frame):
    del frame
    if self.requested is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # second Ctrl-C: stop without waiting for the checkpoint
    self.requested = signum
    # os.write, not print: the handler may interrupt a print to the same stream.
    os.write(
      2,
      f"\n{signal.Signals(signum).name} received: finishing this step and saving a checkpoint "
      "(Ctrl-C again to abort without saving)\n".encode(),
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
