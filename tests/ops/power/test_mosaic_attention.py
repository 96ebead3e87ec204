"""The Mosaic GPU kernels of power attention's in-chunk attention on CPU: GPU interpret mode runs
the same kernel code (TMA copies, barriers, wgmma), and the Mosaic lowering for an H100 runs on CPU.

Against the in-chunk attention written from its definition in float32 (numerator sum_j A_ij v_j
and denominator sum_j A_ij, A_ij = (q_i . k_j)^2 e^{G_i - G_j} within a chunk, causal): the
forward's normalized outputs, with and without a state's part added, and the gradients jax takes;
against the Triton kernels in interpret mode; through the op with
`PowerTritonConfig(in_chunk_attention="mosaic")`. Grouped heads, two chunks of two tiles each, head
dims 64 and 128, a ring shallower than a program's steps, and bad input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lowered_for_h100, mosaic_kernels_lowered_for_h100, rel_err
from ops.power.base import MOSAIC_BAD_SIZES
from pallas_kernels.power import PowerTritonConfig, mosaic_attention, triton_kernels

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

B, HQ, HKV, CHUNK = 1, 4, 2, 128


def _inputs(seed, seq, head_dim, value_dim, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q = (normal(B * HQ, seq, head_dim) * head_dim**-0.5).astype(dtype)
  k = normal(B * HKV, seq, head_dim).astype(dtype)
  v = normal(B * HKV, seq, value_dim).astype(dtype)
  log_g = -np.logaddexp(0.0, -(2.0 + rng.standard_normal((B * HKV, seq // CHUNK, CHUNK))))
  g = jnp.asarray(np.cumsum(log_g, axis=-1).reshape(B * HKV, seq), jnp.float32)
  d_num = normal(B * HQ, seq, value_dim).astype(dtype)
  d_den = normal(B * HQ, seq)
  return q, k, v, g, d_num, d_den


def _in_chunk_attention(q, k, v, g):
  """(numerator [BHq, T, d_v], denominator [BHq, T]) from the definition, float32."""
  group = q.shape[0] // k.shape[0]
  expand = lambda x: jnp.repeat(x, group, axis=0)
  k, v, g = expand(k), expand(v), expand(g)
  seq = q.shape[1]
  position = jnp.arange(seq)
  allowed = (position[:, None] >= position[None, :]) & (position[:, None] // CHUNK == position[None, :] // CHUNK)
  exponent = jnp.where(allowed, g[:, :, None] - g[:, None, :], 0.0)
  weights = jnp.einsum("bid,bjd->bij", q, k) ** 2 * jnp.where(allowed, jnp.exp(exponent), 0.0)
  return jnp.einsum("bij,bje->bie", weights, v), jnp.sum(weights, axis=-1)


def _reference(q, k, v, g, d_num, d_den):
  """(dq, dk, dv, dG) float32; dG summed over both sides, per kv head."""
  f32 = lambda x: x.astype(jnp.float32)
  _, vjp = jax.vjp(_in_chunk_attention, f32(q), f32(k), f32(v), g)
  return vjp((f32(d_num), d_den))


def _mosaic(*inputs, stages=2):
  return mosaic_attention.attention_backward(
    *inputs, heads=HQ, kv_heads=HKV, chunk=CHUNK, stages=stages, interpret=True
  )


def _log_gate_gradient(dg_q, dg_k):
  return dg_q.reshape(B * HKV, HQ // HKV, -1).sum(axis=1) + dg_k


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("head_dim, value_dim, stages", [(64, 64, 2), (128, 64, 1)])
def test_forward_matches_the_definition(head_dim, value_dim, stages, with_state):
  q, k, v, g, _, _ = _inputs(5, 2 * CHUNK, head_dim, value_dim)
  numerator, denominator = _in_chunk_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), g)
  states = ()
  if with_state:
    rng = np.random.default_rng(6)
    states = (
      jnp.asarray(rng.standard_normal(numerator.shape), jnp.float32),
      jnp.asarray(rng.uniform(1, 2, denominator.shape), jnp.float32),
    )
    numerator, denominator = numerator + states[0], denominator + states[1]
  out, den = jax.jit(
    functools.partial(
      mosaic_attention.attention_forward, heads=HQ, kv_heads=HKV, chunk=CHUNK, stages=stages, interpret=True
    )
  )(q, k, v, g, *states)
  assert out.dtype == q.dtype
  assert rel_err(den, denominator) < 1e-2
  assert rel_err(out.astype(jnp.float32), numerator / denominator[..., None]) < 1e-2


@pytest.mark.parametrize("head_dim, value_dim, stages", [(64, 64, 2), (128, 64, 1)])
def test_backward_matches_the_definition(head_dim, value_dim, stages):
  inputs = _inputs(0, 2 * CHUNK, head_dim, value_dim)
  dq, dg_q, dk, dv, dg_k = jax.jit(functools.partial(_mosaic, stages=stages))(*inputs)
  expected_dq, expected_dk, expected_dv, expected_dg = _reference(*inputs)
  assert rel_err(dq, expected_dq) < 1e-2
  assert rel_err(dk, expected_dk) < 1e-2
  assert rel_err(dv, expected_dv) < 1e-2
  assert rel_err(_log_gate_gradient(dg_q, dg_k), expected_dg) < 1e-2


def test_backward_matches_the_triton_kernel():
  inputs = _inputs(1, 2 * CHUNK, 64, 64)
  ours = jax.jit(_mosaic)(*inputs)
  config = PowerTritonConfig(block_t=64, block_q=64, block_k=64, grad_block=64)
  theirs = jax.jit(
    functools.partial(
      triton_kernels.attention_backward, heads=HQ, kv_heads=HKV, chunk=CHUNK, config=config, interpret=True
    )
  )(*inputs)
  for name, a, b in zip(("dq", "dg_q", "dk", "dv", "dg_k"), ours, theirs):
    assert rel_err(a, b) < 1e-2, name


def test_lowers_for_an_h100():
  inputs = _inputs(2, 2 * CHUNK, 64, 64)
  call = functools.partial(mosaic_attention.attention_backward, heads=HQ, kv_heads=HKV, chunk=CHUNK)
  assert mosaic_kernels_lowered_for_h100([call], inputs) == [2]
  forward = functools.partial(mosaic_attention.attention_forward, heads=HQ, kv_heads=HKV, chunk=CHUNK)
  state_parts = (jnp.zeros(inputs[4].shape, jnp.float32), inputs[5])
  assert mosaic_kernels_lowered_for_h100([forward, lambda *a: forward(*a, *state_parts)], inputs[:4]) == [1, 1]


@pytest.mark.parametrize("change, match", MOSAIC_BAD_SIZES)
def test_bad_input(change, match):
  sizes = dict(head_dim=64, value_dim=64, dtype=jnp.bfloat16, chunk=CHUNK, stages=2) | change
  assert match in mosaic_attention.unsupported_reason(**sizes)
  inputs = _inputs(3, 2 * CHUNK, sizes["head_dim"], 64, sizes["dtype"])
  with pytest.raises(ValueError, match=match):
    mosaic_attention.attention_backward(*inputs, heads=HQ, kv_heads=HKV, chunk=sizes["chunk"], stages=sizes["stages"])


# 200 tokens: two chunks (a state enters the second), padded; 100 without the final state: the
# attention form alone.
@pytest.mark.parametrize("seq, return_final_state", [(200, True), (100, False)])
def test_the_op_takes_it_from_the_kernel_config(monkeypatch, seq, return_final_state):
  """power_attention_triton with in_chunk_attention="mosaic": the Mosaic kernels run forward and
  backward, and the outputs and gradients agree with the Triton kernels'; with float32 inputs
  (unsupported) the Triton kernels run."""
  from pallas_kernels.power import power_attention_triton

  calls = []
  for name in ("attention_forward", "attention_backward"):
    kernels = getattr(mosaic_attention, name)
    spy = lambda *a, kernels=kernels, name=name, **kw: calls.append(name) or kernels(*a, **kw)
    monkeypatch.setattr(mosaic_attention, name, spy)
  rng = np.random.default_rng(4)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v = normal(B, seq, HQ, 64), normal(B, seq, HKV, 64), normal(B, seq, HKV, 64)
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((B, seq, HKV)))), jnp.float32)
  cotangent = normal(B, seq, HQ, 64)

  def run(config, dtype):
    def loss(q, k, v, log_g):
      out, _ = power_attention_triton(
        q, k, v, log_g, scale=0.125, chunk_size=CHUNK, config=config, return_final_state=return_final_state
      )
      return jnp.sum(out.astype(jnp.float32) * cotangent), out

    inputs = (q.astype(dtype), k.astype(dtype), v.astype(dtype), log_g)
    grads, out = jax.jit(jax.grad(loss, argnums=range(4), has_aux=True))(*inputs)
    return (out, *grads)

  mosaic = PowerTritonConfig(in_chunk_attention="mosaic")
  ours = run(mosaic, jnp.bfloat16)
  assert sorted(set(calls)) == ["attention_backward", "attention_forward"]
  theirs = run(PowerTritonConfig(), jnp.bfloat16)
  for name, a, b in zip(("out", "q", "k", "v", "log_g"), ours, theirs):
    assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < 2e-2, name
  calls.clear()
  f32 = lambda x: x.astype(jnp.float32)
  power_attention_triton(f32(q), f32(k), f32(v), log_g, scale=0.125, chunk_size=CHUNK, config=mosaic)
  assert not calls
  with pytest.raises(ValueError, match="in_chunk_attention must be one of"):
    PowerTritonConfig(in_chunk_attention="cudnn")


def test_the_op_lowers_for_an_h100_with_it(monkeypatch):
  """Forward and backward of the op on a Hopper GPU with in_chunk_attention="mosaic": the Triton
  states' kernel without the attention, and the three Mosaic kernels."""
  from pallas_kernels import device_facts
  from pallas_kernels.power import power_attention_triton

  monkeypatch.setattr(device_facts, "compute_capability", lambda: "9.0")
  rng = np.random.default_rng(7)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  q, k, v = normal(B, 256, HQ, 64), normal(B, 256, HKV, 64), normal(B, 256, HKV, 64)
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((B, 256, HKV)))), jnp.float32)
  config = PowerTritonConfig(
    in_chunk_attention="mosaic", update_state="triton", query_state="triton", state_gradient="triton"
  )

  def loss(q, k, v, log_g):
    out, _ = power_attention_triton(q, k, v, log_g, scale=0.125, chunk_size=CHUNK, config=config, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  text = lowered_for_h100(jax.grad(loss, argnums=range(4)), (q, k, v, log_g))
  assert "power_query_state" in text and "power_query_state_attention" not in text
  assert text.count("custom_call @mosaic_gpu") == 3
