"""Fixtures the op tests share."""

import jax
import pytest

from pallas_kernels import device_facts


@pytest.fixture
def device(monkeypatch):
  """Fakes a GPU of a compute capability (`helpers.HOPPER`, `helpers.AMPERE`):
  device(capability), so that an op's default implementation can be checked on a CPU."""

  def fake(capability):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(device_facts, "compute_capability", lambda: capability)

  return fake
