"""Semantic cross-check against the paper authors' pure-PyTorch reference.

`retention.reference.power_retention` (PyPI `retention`, the renamed `power-attention`
package of Manifest AI) runs on CPU. Same layout [batch, seq, heads, head_dim], log-gates
[batch, seq, kv_heads], default scale 1/sqrt(head_dim). Its attention form adds 1e-7 inside
the log and 1e-6 to the row sum, so agreement is to about 1e-6 relative, not to rounding.

    pip install retention torch
    python -m pytest tests/ops/power/test_authors_reference.py

Skipped when torch or retention is not installed (neither is a dependency of this library).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import power_attention
from helpers import rel_err

torch = pytest.importorskip("torch")
retention_reference = pytest.importorskip("retention.reference")

BATCH, SEQ, HEAD_DIM = 2, 32, 32


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _inputs(seed, heads, kv_heads, gating):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((BATCH, SEQ, heads, HEAD_DIM), np.float32)
  k = rng.standard_normal((BATCH, SEQ, kv_heads, HEAD_DIM), np.float32)
  v = rng.standard_normal((BATCH, SEQ, kv_heads, HEAD_DIM), np.float32)
  log_g = (-np.logaddexp(0.0, -(2.0 + rng.standard_normal((BATCH, SEQ, kv_heads))))).astype(np.float32)
  return q, k, v, (log_g if gating else None)


def _theirs(inputs, p, chunk_size, requires_grad=False):
  tensors = [None if x is None else torch.tensor(x, requires_grad=requires_grad) for x in inputs]
  out = retention_reference.power_retention(*tensors, deg=p, chunk_size=chunk_size)
  return out, tensors


# (p, chunk_size, gating, heads, kv_heads). chunk_size None is their attention form (any
# even p, grouped-query heads); their chunked reference expands with deg == 2 only, in
# blocks of 16 features, and without grouped-query heads.
CASES = [(2, None, True, 4, 2), (4, None, True, 3, 1), (4, None, False, 2, 2), (2, 8, True, 2, 2), (2, 16, False, 2, 2)]


@pytest.mark.parametrize("p, chunk_size, gating, heads, kv_heads", CASES)
def test_outputs_match_the_authors_reference(p, chunk_size, gating, heads, kv_heads):
  inputs = _inputs(p + heads, heads, kv_heads, gating)
  expected, _ = _theirs(inputs, p, chunk_size)
  expected = expected.detach().numpy()
  ours_reference = power_attention(*inputs, p=p, implementation="reference")
  ours_chunked = power_attention(*inputs, p=p, chunk_size=chunk_size or 8, implementation="xla")
  assert rel_err(ours_reference, expected) < 1e-4
  assert rel_err(ours_chunked, expected) < 1e-4
  # The comparison can fail: p, the gates and the grouping all change their outputs.
  assert rel_err(power_attention(*inputs, p=p + 2, implementation="reference"), expected) > 1e-2


@pytest.mark.parametrize("p, chunk_size", [(2, 8), (4, None)])
def test_gradients_match_the_authors_reference(p, chunk_size):
  inputs = _inputs(10 + p, 2, 2, gating=True)
  cotangent = np.random.default_rng(0).standard_normal((BATCH, SEQ, 2, HEAD_DIM)).astype(np.float32)
  out, tensors = _theirs(inputs, p, chunk_size, requires_grad=True)
  (out * torch.tensor(cotangent)).sum().backward()
  loss = lambda *a: jnp.sum(power_attention(*a, p=p, chunk_size=8) * cotangent)
  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*(jnp.asarray(x) for x in inputs))
  for name, ours, theirs in zip(("q", "k", "v", "log_g"), grads, tensors):
    assert rel_err(ours, theirs.grad.numpy()) < 1e-3, name


def test_gating_convention_matches():
  """Key j's weight for query i is discounted by prod_{l=j+1..i} g_l: a gate at the query's
  own position discounts every earlier key but not the query's own key."""
  inputs = list(_inputs(7, 2, 2, gating=True))
  log_g = np.zeros_like(inputs[3])
  log_g[:, 5] = -3.0  # only token 5 forgets
  inputs[3] = log_g
  expected, _ = _theirs(inputs, 2, None)
  ours = power_attention(*inputs, p=2, implementation="reference")
  assert rel_err(ours, expected.detach().numpy()) < 1e-4
  shifted = np.roll(log_g, 1, axis=1)  # the other convention: token 6 forgets
  assert (
    rel_err(power_attention(*inputs[:3], shifted, p=2, implementation="reference"), expected.detach().numpy()) > 1e-3
  )
