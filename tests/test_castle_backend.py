"""The Pallas backend choice of CASTLE training attention (`CastleKernelConfig.backend`).

The config's validation and parsing; `choose_backend` with the device's compute
capability faked (Hopper follows the table of cases measured faster, other GPUs get
Triton, an explicit "mosaic" on inputs the Mosaic kernels cannot take raises naming
why); the routing of `castle_attention(implementation="pallas")` with both kernel
paths stubbed; and one real run of the Mosaic kernels through `castle_attention` in GPU
interpret mode, output and all six gradients against the blockwise XLA path in float32.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.castle import castle_attention
from helpers import rel_err
from pallas_kernels.castle import CastleKernelConfig, attention, backend
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig

# The Mosaic backward test's random inputs (six bf16 tensors and a cotangent).
from test_castle_mosaic_backward import _NAMES, _inputs

HOPPER = "9.0"
AMPERE = "8.0"


@pytest.fixture
def capability(monkeypatch):
  """Fakes the device's compute capability: capability(value)."""

  def fake(value):
    monkeypatch.setattr(backend, "compute_capability", lambda: value)

  return fake


@pytest.fixture
def measured_faster(monkeypatch):
  """Fills the table of cases where Mosaic measured faster: measured_faster(*cases)."""

  def fill(*cases):
    monkeypatch.setattr(backend, "MOSAIC_FASTER_CASES", frozenset(cases))

  return fill


def _choose(backend_name="auto", dtype=jnp.bfloat16, head_dim=128, window=None, interpret=False, **config):
  return backend.choose_backend(
    CastleKernelConfig(backend=backend_name, **config),
    dtype=dtype,
    head_dim=head_dim,
    window=window,
    interpret=interpret,
  )


def test_config_rejects_unknown_backends():
  with pytest.raises(
    ValueError, match=r"CastleKernelConfig.backend must be one of \('auto', 'triton', 'mosaic'\), got 'cuda'"
  ):
    CastleKernelConfig(backend="cuda")


def test_config_parses_the_backend_from_a_string():
  config = CastleKernelConfig.from_string("backend=mosaic, block_q=64")
  assert config == CastleKernelConfig(backend="mosaic", block_q=64)
  assert config.mosaic_config == CastleMosaicConfig()
  assert CastleKernelConfig.from_string("block_q=64").backend == "auto"
  with pytest.raises(ValueError, match="backend must be one of"):
    CastleKernelConfig.from_string("backend=Mosaic")


def test_auto_on_hopper_follows_the_table(capability, measured_faster):
  capability(HOPPER)
  assert _choose() == "triton"  # the table is empty until Mosaic measures faster
  measured_faster((128, "bfloat16", False))
  assert _choose() == "mosaic"
  assert _choose(window=512) == "triton"  # CASTLE-SWL is another case
  assert _choose(dtype=jnp.float16) == "triton"
  assert _choose(backend_name="triton") == "triton"  # an explicit choice is not overridden
  # A listed case Mosaic cannot take stays on Triton.
  assert _choose(head_dim=96) == "triton"


def test_auto_off_hopper_is_triton(capability, measured_faster):
  measured_faster((128, "bfloat16", False))
  for value in (AMPERE, "10.0", None):
    capability(value)
    assert _choose() == "triton", value


def test_auto_logs_once_why_triton_runs_on_hopper(capability, caplog):
  capability(HOPPER)
  backend._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger=backend.__name__):
    for _ in range(2):
      _choose()
    _choose(dtype=jnp.float32)
  messages = [record.getMessage() for record in caplog.records]
  assert len(messages) == 2, messages
  assert "runs the Triton kernels" in messages[0] and "not measured faster" in messages[0]
  assert "bfloat16 or float16 inputs, got float32" in messages[1]


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(head_dim=96), r"head_dim in \(64, 128\), got 96"),
    (dict(dtype=jnp.float32), "bfloat16 or float16 inputs, got float32"),
  ],
)
def test_mosaic_rejects_inputs_it_cannot_take(capability, change, match):
  capability(HOPPER)
  with pytest.raises(ValueError, match=r"backend='mosaic' cannot run: .*" + match):
    _choose("mosaic", **change)


def test_mosaic_needs_hopper_unless_interpreted(capability):
  capability(AMPERE)
  with pytest.raises(
    ValueError,
    match=r"need a Hopper GPU \(compute capability 9.x\), this is compute capability "
    r"8.0; use CastleKernelConfig\(backend='triton'\)",
  ):
    _choose("mosaic")
  assert _choose("mosaic", interpret=True) == "mosaic"
  capability(HOPPER)
  assert _choose("mosaic") == "mosaic"


@pytest.mark.parametrize(
  "value, table, expected",
  [
    (HOPPER, [(64, "bfloat16", True)], "mosaic"),
    (HOPPER, [], "triton"),
    (AMPERE, [(64, "bfloat16", True)], "triton"),
  ],
)
def test_castle_attention_routes_to_the_chosen_kernels(
  monkeypatch, capability, measured_faster, value, table, expected
):
  """Both kernel paths stubbed: which one runs, with what, under backend="auto"."""
  capability(value)
  measured_faster(*table)
  calls = []

  def stub(name):
    def run(*inputs, **kwargs):
      calls.append((name, kwargs))
      return jnp.zeros_like(inputs[3])

    return run

  monkeypatch.setattr(attention, "castle_attention_mosaic", stub("mosaic"))
  monkeypatch.setattr(attention, "castle_attention_triton", stub("triton"))
  inputs, _ = _inputs(0, (1, 8, 1, 64))
  castle_attention(*inputs, window=3, implementation="pallas", pallas_config=CastleKernelConfig(block_q=16))
  assert [name for name, _ in calls] == [expected]
  if expected == "mosaic":
    assert calls[0][1]["config"] == CastleMosaicConfig() and calls[0][1]["window"] == 3
  else:
    assert calls[0][1]["config"] == CastleKernelConfig(block_q=16)


def test_mosaic_backend_through_castle_attention_matches_xla(monkeypatch):
  """The Mosaic kernels run (interpret mode) when asked for, and their output and
  gradients match the blockwise XLA path in float32."""
  shape, window = (1, 100, 2, 64), None  # 100 tokens: a ragged last block of 64
  inputs, cotangent = _inputs(11, shape)
  configs = []

  def spy(*args, config, **kwargs):
    configs.append(config)
    return castle_attention_mosaic(*args, config=config, **kwargs)

  castle_attention_mosaic = attention.castle_attention_mosaic
  monkeypatch.setattr(attention, "castle_attention_mosaic", spy)
  config = CastleKernelConfig(backend="mosaic")
  out, vjp = jax.vjp(
    lambda *a: castle_attention(*a, window=window, implementation="pallas", pallas_config=config), *inputs
  )
  grads = vjp(cotangent)
  assert configs == [CastleMosaicConfig()]

  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_vjp = jax.vjp(lambda *a: castle_attention(*a, window=window, implementation="xla"), *f32)
    ref_grads = ref_vjp(cotangent.astype(jnp.float32))
  assert out.dtype == jnp.bfloat16 and out.shape == shape
  assert rel_err(out.astype(jnp.float32), ref_out) < 1e-2
  for name, grad, ref in zip(_NAMES, grads, ref_grads):
    assert grad.dtype == jnp.bfloat16 and grad.shape == shape, name
    grad = np.asarray(grad.astype(jnp.float32))
    assert np.isfinite(grad).all(), f"d{name} has unwritten or non-finite elements"
    error = rel_err(grad, ref)
    assert error < 1e-2, f"d{name}: relative error {error:.3g}"
