"""Seconds per phase of a run's start-up, for its banner."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator


class PhaseClock:
  """Times the phases of a run's start-up (`with clock.phase("data"): ...`) and describes
  them: on a GPU the time before the first step can reach a minute or more (initialising
  the backend, compiling the parameters' initialisation, restoring a checkpoint), time a run
  under a limit does not train, and the banner should say where it went."""

  def __init__(self):
    self.started = time.perf_counter()
    self.seconds: dict[str, float] = {}

  @contextlib.contextmanager
  def phase(self, name: str) -> Iterator[None]:
    begun = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begun

  def describe(self) -> str:
    """e.g. "12.3s after the start: model and mesh 1.2s, data 0.4s, parameters 9.8s, other 0.9s"."""
    total = time.perf_counter() - self.started
    parts = [f"{name} {seconds:.1f}s" for name, seconds in self.seconds.items()]
    parts.append(f"other {max(total - sum(self.seconds.values()), 0.0):.1f}s")
    return f"{total:.1f}s after the start: " + ", ".join(parts)
