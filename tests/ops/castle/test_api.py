"""How CASTLE picks its implementation: "reference", "xla", "triton" or "mosaic", or None for
the fastest that runs here (`castle_jax.ops.castle.api`).

The default with the device faked (a Hopper GPU follows the table of cases where the Mosaic
kernels measured faster and logs once why it passes over them elsewhere, other GPUs get
Triton, CPUs XLA); an explicit "mosaic" on inputs or a device the Mosaic kernels cannot take
raises naming why; a kernel config picks (or must match) its implementation; the names
before the kernels were named by backend fail with the new spelling; the routing of
`castle_attention` with both kernel paths stubbed; the Mosaic kernels run with the config
given; prefill and decoding with "mosaic". `test_implementations.py` checks every
implementation's numbers.
"""

import logging

import jax
import jax.numpy as jnp
import pytest

from castle_jax.ops import backend
from castle_jax.ops.castle import api, castle_attention, decode_step, init_cache, prefill
from helpers import AMPERE, HOPPER, rel_err
from pallas_kernels.castle import CastleMosaicConfig, CastleTritonConfig

from ops.castle.base import math_inputs, random_inputs


@pytest.fixture
def measured_faster(monkeypatch):
  """Fills the table of cases where Mosaic measured faster: measured_faster(*cases)."""

  def fill(*cases):
    monkeypatch.setattr(api, "MOSAIC_FASTER_CASES", frozenset(cases))

  return fill


def _choose(requested=None, dtype=jnp.bfloat16, head_dim=128, window=None, kernel_config=None):
  table = api.implementations(dtype, head_dim, window)
  return backend.choose("castle_attention", requested, table, api.DEFAULT_ORDER, kernel_config=kernel_config)


def test_the_default_on_hopper_follows_the_table(device, measured_faster):
  device(HOPPER)
  measured_faster()
  assert _choose() == "triton"
  measured_faster((128, "bfloat16", False))
  assert _choose() == "mosaic"
  assert _choose(window=512) == "triton"  # CASTLE-SWL is another case
  assert _choose(dtype=jnp.float16) == "triton"
  assert _choose("triton") == "triton"  # an explicit choice is not overridden
  assert _choose(kernel_config=CastleTritonConfig()) == "triton"  # nor is the config's implementation


def test_the_shipped_table_takes_mosaic_where_it_measured_faster(device):
  device(HOPPER)
  assert _choose(window=512) == "mosaic" and _choose(head_dim=64) == "mosaic"
  assert _choose() == "triton"  # head dim 128 without a window
  # Inputs the Mosaic kernels cannot take stay on Triton.
  assert _choose(head_dim=96, window=512) == "triton"
  assert _choose(dtype=jnp.float32, head_dim=64) == "triton"


def test_the_default_off_hopper_is_triton(device, measured_faster):
  measured_faster((128, "bfloat16", False))
  for capability in (AMPERE, "10.0", None):
    device(capability)
    assert _choose() == "triton", capability


def test_the_default_logs_once_why_it_passes_over_mosaic(device, measured_faster, caplog):
  device(HOPPER)
  measured_faster()
  backend.log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger=backend.__name__):
    for _ in range(2):
      _choose()
    _choose(head_dim=64)
  messages = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
  assert len(messages) == 2, messages
  assert "castle_attention: implementation=None passes over 'mosaic': not measured faster" in messages[0]
  assert "head_dim 128" in messages[0] and "head_dim 64" in messages[1]


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(head_dim=96), r"head_dim in \(64, 128\), got 96"),
    (dict(dtype=jnp.float32), "bfloat16 or float16 inputs, got float32"),
  ],
)
def test_mosaic_rejects_inputs_it_cannot_take(device, change, match):
  device(HOPPER)
  with pytest.raises(ValueError, match=r"implementation='mosaic' cannot run: .*" + match):
    _choose("mosaic", **change)


def test_mosaic_needs_hopper_unless_interpreted(device):
  device(AMPERE)
  with pytest.raises(
    ValueError,
    match=r"need a Hopper GPU \(compute capability 9.x\), this is compute capability 8.0; use implementation='triton'",
  ):
    _choose("mosaic")
  device(HOPPER)
  assert _choose("mosaic") == "mosaic"


def test_mosaic_runs_anywhere_in_interpret_mode():
  assert jax.default_backend() == "cpu"
  assert _choose("mosaic") == "mosaic"
  assert _choose() == "xla"  # the kernels are a default on a GPU only


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (
      dict(implementation="mosaic", kernel_config=CastleTritonConfig()),
      r"^castle_attention: kernel_config for implementation='mosaic' must be a CastleMosaicConfig \(or None\), "
      r"got a CastleTritonConfig$",
    ),
    (
      dict(implementation="xla", kernel_config=CastleMosaicConfig()),
      r"implementation='xla' takes no kernel_config, got a CastleMosaicConfig",
    ),
    (
      dict(kernel_config="block_q=64"),
      r"kernel_config must be one of \['CastleMosaicConfig', 'CastleTritonConfig'\] \(or None\)",
    ),
    # The spellings from before the kernels were named by backend.
    (
      dict(implementation="pallas"),
      r"^castle_attention: implementation='pallas' is now 'triton' or 'mosaic' "
      r"\(None picks the fastest that runs here\)$",
    ),
    (dict(pallas_config=CastleTritonConfig()), r"^castle_attention: pallas_config= is now kernel_config= "),
  ],
)
def test_bad_kernel_configs_and_old_spellings_name_the_fix(kwargs, match):
  inputs, _ = random_inputs(0, (1, 8, 1, 64))
  with pytest.raises(ValueError, match=match):
    castle_attention(*inputs, **kwargs)


def test_a_backend_field_names_the_implementation():
  with pytest.raises(
    ValueError, match=r"CastleTritonConfig has no key 'backend' .*implementation='triton' or 'mosaic'"
  ):
    CastleTritonConfig.from_string("backend=mosaic")


@pytest.mark.parametrize(
  "capability, table, expected",
  [
    (HOPPER, [(64, "bfloat16", True)], "mosaic"),
    (HOPPER, [], "triton"),
    (AMPERE, [(64, "bfloat16", True)], "triton"),
  ],
)
def test_castle_attention_routes_to_the_chosen_kernels(
  monkeypatch, device, measured_faster, capability, table, expected
):
  """Both kernel paths stubbed: which one the default runs, and with what."""
  device(capability)
  measured_faster(*table)
  calls = []

  def stub(name):
    def run(*inputs, **kwargs):
      calls.append((name, kwargs))
      return jnp.zeros_like(inputs[3])

    return run

  monkeypatch.setattr(api, "castle_attention_mosaic", stub("mosaic"))
  monkeypatch.setattr(api, "castle_attention_triton", stub("triton"))
  inputs, _ = random_inputs(0, (1, 8, 1, 64))
  castle_attention(*inputs, window=3)
  assert [name for name, _ in calls] == [expected]
  assert calls[0][1]["config"] is None and calls[0][1]["window"] == 3 and calls[0][1]["interpret"] is False


def test_mosaic_runs_with_the_config_given(monkeypatch):
  """The Mosaic kernels run (interpret mode) when asked for, with the config given (their
  output and gradients against the parallel form: test_implementations.py)."""
  shape = (1, 100, 2, 64)  # 100 tokens: a ragged last block of 64
  inputs, _ = random_inputs(11, shape)
  configs = []

  def spy(*args, config, **kwargs):
    configs.append(config)
    return castle_attention_mosaic(*args, config=config, **kwargs)

  castle_attention_mosaic = api.castle_attention_mosaic
  monkeypatch.setattr(api, "castle_attention_mosaic", spy)
  config = CastleMosaicConfig()
  out = castle_attention(*inputs, implementation="mosaic", kernel_config=config)
  assert configs == [config] and out.shape == shape and bool(jnp.isfinite(out.astype(jnp.float32)).all())


def test_mosaic_prefill_fills_the_cache_as_the_blockwise_prefill_does():
  """implementation="mosaic" prefills with the Mosaic forward (its final D is U^L), and a
  decoding step then runs the Triton decoding kernel."""
  shape, window = (1, 100, 2, 64), 40
  inputs, _ = random_inputs(12, shape)
  cache = init_cache(1, 104, 2, 64, jnp.bfloat16, window)
  out, filled = prefill(cache, *inputs, implementation="mosaic")
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_filled = prefill(init_cache(1, 104, 2, 64, jnp.float32, window), *f32, implementation="xla")
  assert out.dtype == jnp.bfloat16 and rel_err(out.astype(jnp.float32), ref_out) < 1e-2
  assert rel_err(filled.lookahead_keys.astype(jnp.float32), ref_filled.lookahead_keys) < 1e-2
  assert int(filled.length) == 100
  token = tuple(x[:, :1] for x in random_inputs(13, (1, 1, 2, 64))[0])
  stepped = {name: decode_step(filled, *token, implementation=name) for name in ("mosaic", "triton")}
  assert rel_err(stepped["mosaic"][0].astype(jnp.float32), stepped["triton"][0].astype(jnp.float32)) == 0.0


@pytest.mark.usefixtures("full_float32_matmuls")
def test_default_implementation_is_xla_and_logged(caplog):
  inputs = math_inputs(seed=90)
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    out = castle_attention(*inputs, window=3, block_size=4)
  assert "xla" in caplog.text
  assert rel_err(out, castle_attention(*inputs, window=3, implementation="reference")) < 1e-5


@pytest.mark.parametrize("index, name", [(1, "k_u"), (4, "k_c"), (5, "v_c")])
def test_mismatched_shape_or_dtype_names_the_argument(index, name):
  inputs = list(math_inputs(seed=92))
  bad_shape = inputs.copy()
  bad_shape[index] = inputs[index][:, :5]
  with pytest.raises(ValueError, match=name):
    castle_attention(*bad_shape)
  bad_dtype = inputs.copy()
  bad_dtype[index] = inputs[index].astype(jnp.bfloat16)
  with pytest.raises(ValueError, match=f"{name} has dtype"):
    castle_attention(*bad_dtype)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(window=0), "window"),
    (dict(window=-2), "window"),
    (dict(window=2.5), "window"),
    (dict(implementation="flash"), "castle_attention: unknown implementation .flash."),
    (dict(block_size=0), "block_size"),
  ],
)
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    castle_attention(*math_inputs(seed=93), **kwargs)


def test_bad_rank_and_head_dim():
  inputs = math_inputs(seed=94)
  with pytest.raises(ValueError, match=r"q_u must have shape \[batch, seq, heads, head_dim\]"):
    castle_attention(inputs[0][0], *inputs[1:])
  empty_head = math_inputs(seed=94, shape=(1, 3, 2, 0))
  with pytest.raises(ValueError, match="head_dim"):
    castle_attention(*empty_head)
