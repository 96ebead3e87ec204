"""The Mosaic GPU update-state kernel of power attention on CPU: GPU interpret mode runs the same
kernel code, and the Mosaic lowering for an H100 runs on CPU.

Against each chunk's state and normalizer from the definition with the tspow expansion (16-feature
tiles) in float32, and against the Triton kernel in interpret mode; head dims 64 and 128, two
chunks of two token tiles, a ring shallower than the tiles, and bad input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import expand
from helpers import lowered_for_h100, mosaic_kernels_lowered_for_h100, rel_err
from ops.power.base import MOSAIC_BAD_SIZES
from pallas_kernels.power import PowerTritonConfig, mosaic_update_state, triton_kernels

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

BH, CHUNK = 2, 128


def _inputs(seed, seq, head_dim, value_dim, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((BH, seq, head_dim)) * head_dim**-0.25, dtype)
  w = jnp.asarray(rng.standard_normal((BH, seq, value_dim)), dtype)
  u = jnp.asarray(rng.uniform(0.1, 1.0, (BH, seq)), jnp.float32)
  return x, w, u


def _definition(x, w, u):
  """Each chunk's phi(x)^T w and phi(x)^T u, float32 [BH, n, D, d_v] and [BH, n, D]."""
  phi = expand(x.astype(jnp.float32), 2, "tspow", 16).reshape(BH, -1, CHUNK, triton_kernels.expanded_dim(x.shape[-1]))
  chunks = lambda a: a.astype(jnp.float32).reshape(BH, -1, CHUNK, *a.shape[2:])
  return jnp.einsum("bntD,bnte->bnDe", phi, chunks(w)), jnp.einsum("bntD,bnt->bnD", phi, chunks(u))


# Two chunks at head dim 64; one at 128 (144 row blocks: interpret mode's time).
@pytest.mark.parametrize("head_dim, value_dim, stages, chunks", [(64, 64, 2, 2), (128, 64, 1, 1)])
def test_matches_the_definition(head_dim, value_dim, stages, chunks):
  x, w, u = _inputs(0, chunks * CHUNK, head_dim, value_dim)
  state, normalizer = jax.jit(
    functools.partial(mosaic_update_state.update_state, chunk=CHUNK, stages=stages, interpret=True)
  )(x, w, u)
  expected_state, expected_normalizer = _definition(x, w, u)
  assert state.shape == expected_state.shape and normalizer.shape == expected_normalizer.shape
  assert rel_err(state, expected_state) < 1e-2
  assert rel_err(normalizer, expected_normalizer) < 1e-2


def test_matches_the_triton_kernel():
  x, w, u = _inputs(1, 2 * CHUNK, 64, 64)
  ours = jax.jit(functools.partial(mosaic_update_state.update_state, chunk=CHUNK, interpret=True))(x, w, u)
  theirs = jax.jit(
    functools.partial(triton_kernels.update_state, chunk=CHUNK, config=PowerTritonConfig(), interpret=True)
  )(x, w, u)
  for a, b in zip(ours, theirs):
    assert rel_err(a, b) < 1e-2


def test_lowers_for_an_h100():
  call = functools.partial(mosaic_update_state.update_state, chunk=CHUNK)
  assert mosaic_kernels_lowered_for_h100([call], _inputs(2, 2 * CHUNK, 64, 64)) == [1]


@pytest.mark.parametrize("change, match", MOSAIC_BAD_SIZES)
def test_bad_input(change, match):
  sizes = dict(head_dim=64, value_dim=64, dtype=jnp.bfloat16, chunk=CHUNK, stages=2) | change
  assert match in mosaic_update_state.unsupported_reason(**sizes)
  x, w, u = _inputs(3, 2 * CHUNK, sizes["head_dim"], 64, sizes["dtype"])
  with pytest.raises(ValueError, match=match):
    mosaic_update_state.update_state(x, w, u, chunk=sizes["chunk"], stages=sizes["stages"])


def _op_inputs(seed, seq, heads=4, kv_heads=2, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((1, seq, kv_heads)))), jnp.float32)
  return normal(1, seq, heads, 64), normal(1, seq, kv_heads, 64), normal(1, seq, kv_heads, 64), log_g


def test_the_op_takes_it_from_the_kernel_config(monkeypatch):
  """power_attention_triton with update_state="mosaic": the Mosaic kernel makes the keys' chunk
  states (forward) and the queries' (backward); outputs, final state and gradients agree with the
  Triton kernel's; with float32 inputs (unsupported) the Triton kernel runs."""
  from pallas_kernels.power import power_attention_triton

  calls = []
  kernel = mosaic_update_state.update_state
  monkeypatch.setattr(mosaic_update_state, "update_state", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  q, k, v, log_g = _op_inputs(4, 100)  # two chunks of 64, padded
  cotangent = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.float32)

  def run(config, dtype):
    def loss(q, k, v, log_g):
      out, (state, _) = power_attention_triton(q, k, v, log_g, scale=0.125, chunk_size=64, config=config)
      return jnp.sum(out.astype(jnp.float32) * cotangent), (out, state)

    inputs = (q.astype(dtype), k.astype(dtype), v.astype(dtype), log_g)
    grads, (out, state) = jax.jit(jax.grad(loss, argnums=range(4), has_aux=True))(*inputs)
    return (out, state, *grads)

  mosaic = PowerTritonConfig(update_state="mosaic")
  ours = run(mosaic, jnp.bfloat16)
  assert len(calls) == 2
  theirs = run(PowerTritonConfig(), jnp.bfloat16)
  for name, a, b in zip(("out", "state", "q", "k", "v", "log_g"), ours, theirs):
    assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < 2e-2, name
  calls.clear()
  f32 = lambda x: x.astype(jnp.float32)
  power_attention_triton(f32(q), f32(k), f32(v), log_g, scale=0.125, chunk_size=64, config=mosaic)
  assert not calls
  with pytest.raises(ValueError, match="update_state must be one of"):
    PowerTritonConfig(update_state="xla")


def test_the_op_lowers_for_an_h100_with_every_mosaic_kernel(monkeypatch):
  """Forward and backward with every part that can on Mosaic GPU: two update-state kernels, the
  states' part of the outputs, three attention kernels and two state-gradient kernels."""
  from pallas_kernels import device_facts
  from pallas_kernels.power import power_attention_triton

  monkeypatch.setattr(device_facts, "compute_capability", lambda: "9.0")
  config = PowerTritonConfig(
    update_state="mosaic", in_chunk_attention="mosaic", query_state="mosaic", state_gradient="mosaic"
  )

  def loss(q, k, v, log_g):
    out, _ = power_attention_triton(q, k, v, log_g, scale=0.125, chunk_size=CHUNK, config=config, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  text = lowered_for_h100(jax.grad(loss, argnums=range(4)), _op_inputs(6, 256))
  for triton_kernel in ("power_update_state", "power_query_state", "power_state_gradient", "power_attention_d"):
    assert triton_kernel not in text, triton_kernel
  assert text.count("custom_call @mosaic_gpu") == 8
