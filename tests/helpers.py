"""Small shared utilities for the tests."""

import numpy as np


def rel_err(x, y) -> float:
  """||x - y|| / ||y||, in float64."""
  x = np.asarray(x, np.float64)
  y = np.asarray(y, np.float64)
  return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
