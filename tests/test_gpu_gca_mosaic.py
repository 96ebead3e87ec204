"""The compiled GCA Mosaic GPU forward on a Hopper GPU at real sizes (skipped without one).

Outputs against the XLA path computing in float32 with full-precision matmuls, and the
per-slot log-normalizers against the Triton forward's (same layout and units, so the
Triton backward can consume them): the drt_128m shape (12 heads x 64, query chunks of 63
tokens + a landmark = 64 positions, memory chunks of 63 keys, k = 8) in bf16 with the
default ring and a deeper one, and grouped heads at head dim 128 with 65-position query
chunks (two 64-row tiles each). Retrievals come from `select_chunks` over causal scores, as
in DRT: the first query chunks have empty slots (weight 0, index 0) and early memory chunks
are retrieved by many query chunks.
"""

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops.gca import gca_attention, retrieval_scores, select_chunks
from helpers import rel_err
from pallas_kernels.gca import kernels
from pallas_kernels.gca.config import default_config
from pallas_kernels.gca.mosaic_forward import CHUNK_TILE, gca_forward_mosaic
from pallas_kernels.gca.ops import tiling_for

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("full_float32_matmuls")]


def _is_hopper() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _inputs(seed, *, batch, query_chunks, query_len, heads, kv_heads, head_dim, chunk_len, top_k, dtype):
  keys = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(keys[0], (batch, query_chunks * query_len, heads, head_dim), jnp.float32)
  chunk_k = jax.random.normal(keys[1], (batch, query_chunks, chunk_len, kv_heads, head_dim), jnp.float32)
  chunk_v = jax.random.normal(keys[2], (batch, query_chunks, chunk_len, kv_heads, head_dim), jnp.float32)
  landmarks = jax.random.normal(keys[3], (batch, query_chunks, 32), jnp.float32)
  states = jax.random.normal(keys[4], (batch, query_chunks, 32), jnp.float32)
  indices, weights = select_chunks(retrieval_scores(states, landmarks), top_k, gumbel_rng=keys[5])
  return q.astype(dtype), chunk_k.astype(dtype), chunk_v.astype(dtype), weights, indices


def _triton_lse(inputs, *, query_chunks, query_len, heads, kv_heads, head_dim, chunk_len, **_):
  """The Triton forward's log-normalizers [batch, query_chunks, k, query_len, heads] (query_len a
  multiple of 64, so that no query rows are padded)."""
  q, chunk_k, chunk_v, weights, indices = inputs
  tiling = tiling_for(query_len, heads // kv_heads, chunk_len, default_config())
  padding = ((0, 0), (0, 0), (0, CHUNK_TILE - chunk_len), (0, 0), (0, 0))
  queries = q.reshape(q.shape[0], query_chunks, query_len, heads, head_dim)
  forward = jax.jit(lambda *a: kernels.forward(*a, tiling=tiling, scale=head_dim ** -0.5, config=default_config(),
                                               interpret=False)[1])
  return forward(queries, jnp.pad(chunk_k, padding), jnp.pad(chunk_v, padding), weights,
                 jnp.clip(indices, 0, chunk_k.shape[1] - 1))


DRT_128M = dict(batch=2, query_chunks=64, query_len=64, heads=12, kv_heads=12, head_dim=64, chunk_len=63, top_k=8)


@pytest.mark.parametrize("shape, stages", [
    (DRT_128M, 2),
    (DRT_128M, 3),
    (dict(batch=1, query_chunks=32, query_len=65, heads=8, kv_heads=2, head_dim=128, chunk_len=64, top_k=4), 2),
])
def test_compiled_forward_matches_the_xla_path(shape, stages):
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper (sm_90) GPU")
  inputs = _inputs(0, **shape, dtype=jnp.bfloat16)
  scale = shape["head_dim"] ** -0.5
  out, lse = jax.jit(lambda *a: gca_forward_mosaic(*a, scale=scale, stages=stages))(*inputs)
  inputs32 = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs)
  reference = jax.jit(lambda *a: gca_attention(*a, implementation="xla"))(*inputs32)
  assert out.dtype == jnp.bfloat16 and out.shape == inputs[0].shape
  assert rel_err(out, reference) < 1e-2, rel_err(out, reference)
  if shape["query_len"] % 64 == 0:
    triton_lse = _triton_lse(inputs, **shape)
    assert lse.shape == triton_lse.shape
    assert rel_err(lse, triton_lse) < 1e-3, rel_err(lse, triton_lse)


def test_compiled_forward_is_deterministic():
  if not _is_hopper():
    pytest.skip("the Mosaic GPU kernel needs a Hopper (sm_90) GPU")
  inputs = _inputs(1, **DRT_128M, dtype=jnp.bfloat16)
  forward = jax.jit(lambda *a: gca_forward_mosaic(*a, scale=DRT_128M["head_dim"] ** -0.5))
  first, second = forward(*inputs), forward(*inputs)
  for a, b in zip(first, second):
    assert bool(jnp.all(a == b))
