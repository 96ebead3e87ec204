"""Which kernels `PowerTritonConfig`'s "auto" choices run: per part, the Mosaic GPU kernels on a
Hopper GPU for bf16 heads in `AUTO_MOSAIC_HEAD_DIMS[part]`, the Triton kernels elsewhere (another
GPU, float32 or float16, other head dims, interpret mode); an explicit "triton" or "mosaic" wins.

The op is lowered for an H100 on CPU (the compute capability patched), and the Mosaic GPU kernel
calls in its forward and backward are counted: two update-state kernels (the keys' chunk states,
the queries' in the backward), the states' part of the outputs, three attention kernels
(forward, queries' and keys' backward), two state-gradient kernels (queries', keys').
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import lowered_for_h100
from pallas_kernels import device_facts
from pallas_kernels.power import PowerTritonConfig, power_attention_triton, triton_kernels

CHUNK = 128
TRITON = dict(in_chunk_attention="triton", update_state="triton", query_state="triton", state_gradient="triton")


def _inputs(head_dim, dtype, seq=256, heads=4, kv_heads=2):
  rng = np.random.default_rng(head_dim)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((1, seq, kv_heads)))), jnp.float32)
  return (
    normal(1, seq, heads, head_dim),
    normal(1, seq, kv_heads, head_dim),
    normal(1, seq, kv_heads, head_dim),
    log_g,
  )


def _mosaic_kernels(monkeypatch, config, inputs, capability="9.0"):
  monkeypatch.setattr(device_facts, "compute_capability", lambda: capability)

  def loss(q, k, v, log_g):
    out, _ = power_attention_triton(q, k, v, log_g, scale=0.125, chunk_size=CHUNK, config=config, interpret=False)
    return jnp.sum(out.astype(jnp.float32))

  return lowered_for_h100(jax.grad(loss, argnums=range(4)), inputs).count("custom_call @mosaic_gpu")


@pytest.mark.parametrize(
  "head_dim, kernels",
  [
    (64, 7),  # every part but the queries' state gradient
    (128, 3),  # the in-chunk attention alone
  ],
)
def test_auto_runs_the_parts_measured_faster_on_mosaic(monkeypatch, head_dim, kernels):
  assert PowerTritonConfig().in_chunk_attention == "auto"
  assert _mosaic_kernels(monkeypatch, PowerTritonConfig(), _inputs(head_dim, jnp.bfloat16)) == kernels


@pytest.mark.parametrize(
  "case, dtype, capability, config",
  [
    ("an A100", jnp.bfloat16, "8.0", {}),
    ("float32", jnp.float32, "9.0", {}),
    ("float16 (not measured)", jnp.float16, "9.0", {}),
    ("explicit triton", jnp.bfloat16, "9.0", TRITON),
  ],
)
def test_auto_runs_triton_elsewhere(monkeypatch, case, dtype, capability, config):
  inputs = _inputs(64, dtype)
  assert _mosaic_kernels(monkeypatch, PowerTritonConfig(**config), inputs, capability) == 0, case


def test_explicit_mosaic_parts_run_alone(monkeypatch):
  """One part asked for on Mosaic GPU, the others pinned to Triton: only that part's kernels."""
  inputs = _inputs(64, jnp.bfloat16)
  parts = {"update_state": 2, "state_gradient": 2, "in_chunk_attention": 3}
  for part, kernels in parts.items():
    config = PowerTritonConfig(**{**TRITON, part: "mosaic"})
    assert _mosaic_kernels(monkeypatch, config, inputs) == kernels, part


def test_auto_runs_triton_in_interpret_mode(monkeypatch):
  """Interpret mode (CPU tests) keeps the Triton kernels under "auto", even on a patched Hopper."""
  monkeypatch.setattr(device_facts, "compute_capability", lambda: "9.0")
  calls = []
  original = triton_kernels.update_state
  monkeypatch.setattr(triton_kernels, "update_state", lambda *a, **k: calls.append(1) or original(*a, **k))
  q, k, v, log_g = _inputs(64, jnp.bfloat16)
  power_attention_triton(q, k, v, log_g, scale=0.125, chunk_size=CHUNK, config=PowerTritonConfig(), interpret=True)
  assert calls


def test_parts_on_mosaic_names_what_runs(monkeypatch):
  from pallas_kernels.power.triton import parts_on_mosaic

  monkeypatch.setattr(device_facts, "compute_capability", lambda: "9.0")
  parts = lambda config, head_dim=64, dtype=jnp.bfloat16, interpret=False: parts_on_mosaic(
    config, head_dim=head_dim, value_dim=head_dim, dtype=dtype, chunk=CHUNK, interpret=interpret
  )
  assert parts(PowerTritonConfig()) == ("in_chunk_attention", "update_state", "query_state", "state_gradient_keys")
  assert parts(PowerTritonConfig(), head_dim=128) == ("in_chunk_attention",)
  assert parts(PowerTritonConfig(), dtype=jnp.float32) == ()
  assert parts(PowerTritonConfig(), interpret=True) == ()
  # The states' part follows the in-chunk attention onto Triton.
  assert parts(PowerTritonConfig(in_chunk_attention="triton")) == ("update_state", "state_gradient_keys")
  every = PowerTritonConfig(
    in_chunk_attention="mosaic", update_state="mosaic", query_state="mosaic", state_gradient="mosaic"
  )
  assert len(parts(every, interpret=True)) == 5
  monkeypatch.setattr(device_facts, "compute_capability", lambda: "8.0")
  assert parts(PowerTritonConfig()) == parts(every) == ()


def test_mosaic_stages_reach_every_mosaic_kernel(monkeypatch):
  """`mosaic_stages` is the ring depth of each Mosaic GPU kernel the op calls, forward and backward
  (traced with every part on Mosaic GPU in interpret mode; nothing runs)."""
  from pallas_kernels.power import mosaic_attention, mosaic_query_state, mosaic_state_gradient, mosaic_update_state

  seen = {}
  for module, name in [
    (mosaic_update_state, "update_state"),
    (mosaic_query_state, "query_state"),
    (mosaic_attention, "attention_forward"),
    (mosaic_attention, "attention_backward"),
    (mosaic_state_gradient, "state_gradient"),
  ]:
    original = getattr(module, name)

    def recording(*args, original=original, name=name, **kwargs):
      seen.setdefault(name, set()).add(kwargs["stages"])
      return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
  config = PowerTritonConfig(
    in_chunk_attention="mosaic", update_state="mosaic", query_state="mosaic", state_gradient="mosaic", mosaic_stages=3
  )

  def loss(q, k, v, log_g):
    out, _ = power_attention_triton(q, k, v, log_g, scale=0.125, chunk_size=CHUNK, config=config, interpret=True)
    return jnp.sum(out.astype(jnp.float32))

  jax.eval_shape(jax.grad(loss, argnums=range(4)), *_inputs(64, jnp.bfloat16))
  assert seen == {name: {3} for name in seen} and len(seen) == 5, seen
  with pytest.raises(ValueError, match=r"PowerTritonConfig.mosaic_stages must be an int >= 1, got 0"):
    PowerTritonConfig(mosaic_stages=0)


def test_bad_choice_names_the_field_and_the_choices():
  with pytest.raises(ValueError, match=r"state_gradient must be one of \('auto', 'triton', 'mosaic'\), got 'fast'"):
    PowerTritonConfig(state_gradient="fast")
