"""The Pallas backend choice of GCA (`GcaKernelConfig.backend`, `pallas_kernels.gca.backend`).

The config's validation and parsing; `choose_backend` with the device's compute capability
faked (Hopper runs Mosaic where its kernels take the inputs, other GPUs and CPUs get Triton;
an explicit "mosaic" that cannot run raises naming why; "auto" passing over Mosaic on Hopper
logs why, once); and runs through `castle_jax.ops.gca.gca_attention(implementation="pallas")`
in GPU interpret mode, with the Mosaic kernels spied on and the Triton kernels made to fail:
output and all four gradients against autodiff of the XLA path in float32; and the compiled
(not interpreted) path lowered for an H100, where "auto" on Hopper holds only Mosaic kernels.
"""

import logging

import jax
from jax.sharding import AbstractDevice, AbstractMesh
import jax.numpy as jnp
import pytest

from castle_jax.ops.gca import gca_attention
from helpers import rel_err
from pallas_kernels.gca import GcaKernelConfig, backend, gca_attention_pallas, kernels, mosaic_attention
from pallas_kernels.gca.ops import unsupported_reason
from test_gca_mosaic import gca_inputs

HOPPER = "9.0"
AMPERE = "8.0"
# drt_128m's per-head sizes: head dim 64, 64-row query chunks, 63-key memory chunks, k = 8.
DRT = dict(dtype=jnp.bfloat16, head_dim=64, chunk_len=63, query_len=64, heads=12, kv_heads=12, top_k=8)


@pytest.fixture
def capability(monkeypatch):
  """Fakes the device's compute capability: capability(value)."""

  def fake(value):
    monkeypatch.setattr(backend, "compute_capability", lambda: value)

  return fake


def _choose(backend_name="auto", interpret=False, mosaic_stages=2, **changes):
  return backend.choose_backend(
    GcaKernelConfig(backend=backend_name, mosaic_stages=mosaic_stages), **dict(DRT, interpret=interpret, **changes)
  )


def test_config_validates_and_parses_the_backend():
  assert GcaKernelConfig().backend == "auto" and GcaKernelConfig().mosaic_stages == 2
  assert GcaKernelConfig.from_string("backend=mosaic,mosaic_stages=3") == GcaKernelConfig(
    backend="mosaic", mosaic_stages=3
  )
  with pytest.raises(
    ValueError,
    match=r"GcaKernelConfig.backend must be one of \('auto', 'triton', 'mosaic'\), "
    r"got 'Mosaic'",
  ):
    GcaKernelConfig.from_string("backend=Mosaic")
  with pytest.raises(ValueError, match="mosaic_stages must be an int >= 1, got 0"):
    GcaKernelConfig(mosaic_stages=0)


def test_auto_runs_mosaic_on_hopper_where_it_takes_the_inputs(capability):
  capability(HOPPER)
  assert _choose() == "mosaic"
  assert _choose(dtype=jnp.float16, head_dim=128, chunk_len=64, query_len=65, heads=8, kv_heads=2) == "mosaic"
  assert _choose(backend_name="triton") == "triton"  # an explicit choice is not overridden
  for changes in (dict(dtype=jnp.float32), dict(head_dim=32), dict(chunk_len=65), dict(mosaic_stages=20)):
    assert _choose(**changes) == "triton", changes


def test_auto_on_hopper_accepts_what_only_the_mosaic_kernels_take(capability):
  """Grouped heads of 128: past the Triton memory-side kernel's shared memory, within the
  Mosaic kernels'. The op-level check must ask the kernels that "auto" will run."""
  sizes = dict(head_dim=128, chunk_len=64, heads=8, kv_heads=2, dtype=jnp.bfloat16, query_len=65, top_k=4)
  explicit = GcaKernelConfig()  # run as given: the Triton stages are not lowered to fit
  capability(HOPPER)
  assert unsupported_reason(**sizes, config=explicit) is None
  assert "shared memory" in unsupported_reason(**sizes, config=GcaKernelConfig(backend="triton"))
  capability(AMPERE)
  assert "shared memory" in unsupported_reason(**sizes, config=explicit)


def test_auto_off_hopper_is_triton(capability):
  for value in (AMPERE, "10.0", None):
    capability(value)
    assert _choose() == "triton", value
    assert _choose(interpret=True) == "triton", value  # interpret mode alone does not pick Mosaic


def test_auto_logs_once_why_triton_runs_on_hopper(capability, caplog):
  capability(HOPPER)
  backend._log_once.cache_clear()
  with caplog.at_level(logging.INFO, logger=backend.__name__):
    for _ in range(2):
      _choose(dtype=jnp.float32)
    _choose(head_dim=32)
    _choose()  # Mosaic runs: nothing to say
  messages = [record.getMessage() for record in caplog.records]
  assert len(messages) == 2, messages
  assert "backend='auto' runs the Triton kernels on this compute capability 9.0 GPU" in messages[0]
  assert "got dtype float32" in messages[0] and "got 32" in messages[1]


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(dtype=jnp.float32), "got dtype float32; cast q, chunk_k and chunk_v or use the Triton kernels"),
    (dict(head_dim=256), r"head_dim in \(64, 128\)"),
    (dict(chunk_len=128), "memory chunks of 1..64 keys"),
    (dict(mosaic_stages=20, head_dim=128), "mosaic_stages=20 asks for about .* KiB of shared memory"),
  ],
)
def test_explicit_mosaic_names_why_it_cannot_run(capability, changes, message):
  capability(HOPPER)
  with pytest.raises(ValueError, match=f"GcaKernelConfig.backend='mosaic' cannot run: .*{message}"):
    _choose(backend_name="mosaic", **changes)


def test_explicit_mosaic_needs_hopper_unless_interpreted(capability):
  capability(AMPERE)
  with pytest.raises(
    ValueError,
    match=r"need a Hopper GPU \(compute capability 9.x\), this is compute capability "
    r"8.0; use GcaKernelConfig\(backend='triton'\)",
  ):
    _choose(backend_name="mosaic")
  assert _choose(backend_name="mosaic", interpret=True) == "mosaic"
  assert _choose(backend_name="triton") == "triton"


def test_explicit_mosaic_through_the_entry_point_raises_for_what_it_cannot_take():
  sizes = dict(heads=2, kv_heads=2, head_dim=32, chunk_len=63, dtype=jnp.bfloat16)
  mosaic = GcaKernelConfig(backend="mosaic")
  assert "head_dim in (64, 128)" in unsupported_reason(**sizes, config=mosaic)
  assert unsupported_reason(**sizes) is None  # the Triton kernels take it
  inputs = gca_inputs(0, batch=1, query_chunks=2, query_len=8, memory_chunks=3, top_k=2, **sizes)
  with pytest.raises(ValueError, match=r"head_dim in \(64, 128\)"):
    gca_attention(*inputs, implementation="pallas", pallas_config=mosaic)


@pytest.fixture
def spied_kernels(monkeypatch):
  """Counts the Mosaic kernels' calls (by name) and makes any Triton kernel call fail."""
  calls = []
  for name in ("forward_native", "backward_queries_native", "backward_memory_native"):

    def spy(*args, _name=name, _kernel=getattr(mosaic_attention, name), **kwargs):
      calls.append(_name)
      return _kernel(*args, **kwargs)

    monkeypatch.setattr(mosaic_attention, name, spy)
  for name in ("forward", "backward_queries", "backward_memory"):

    def refuse(*args, _name=name, **kwargs):
      raise AssertionError(f"the Triton kernel {_name} ran")

    monkeypatch.setattr(kernels, name, refuse)
  return calls


def test_pallas_runs_the_mosaic_kernels_and_matches_xla(spied_kernels):
  """backend="mosaic" in interpret mode on CPU. That "auto" picks the same kernels on a
  Hopper GPU is checked without running them (the lowering test below)."""
  pallas_config = GcaKernelConfig(backend="mosaic")
  shape = dict(
    batch=1,
    query_chunks=2,
    query_len=64,
    heads=2,
    kv_heads=2,
    head_dim=64,
    memory_chunks=3,
    chunk_len=63,
    top_k=2,
    dtype=jnp.bfloat16,
  )
  inputs = gca_inputs(0, **shape)
  *differentiable, indices = inputs
  cotangent = jax.random.normal(jax.random.key(1), inputs[0].shape, jnp.float32)

  def value_and_grads(args, **options):
    attention = lambda *a: gca_attention(*a, indices, **options)
    loss = lambda *a: jnp.sum(attention(*a).astype(jnp.float32) * cotangent)
    return jax.jit(attention)(*args), jax.jit(jax.grad(loss, argnums=range(4)))(*args)

  out, grads = value_and_grads(differentiable, implementation="pallas", pallas_config=pallas_config)
  assert sorted(set(spied_kernels)) == ["backward_memory_native", "backward_queries_native", "forward_native"]
  ref_out, ref_grads = value_and_grads([x.astype(jnp.float32) for x in differentiable], implementation="xla")
  assert out.dtype == jnp.bfloat16 and rel_err(out, ref_out) < 1e-2, rel_err(out, ref_out)
  for name, grad, ref in zip(("q", "chunk_k", "chunk_v", "chunk_weights"), grads, ref_grads):
    assert rel_err(grad, ref) < 1e-2, (name, rel_err(grad, ref))


@pytest.mark.parametrize(
  "backend_name, device, mosaic", [("auto", HOPPER, True), ("triton", HOPPER, False), ("auto", AMPERE, False)]
)
def test_value_and_gradients_lower_for_an_h100(capability, backend_name, device, mosaic):
  capability(device)
  struct = jax.ShapeDtypeStruct
  memory = struct((1, 4, 63, 12, 64), jnp.bfloat16)
  args = (
    struct((1, 4 * 64, 12, 64), jnp.bfloat16),
    memory,
    memory,
    struct((1, 4, 8), jnp.float32),
    struct((1, 4, 8), jnp.int32),
  )
  config = GcaKernelConfig(backend=backend_name)

  def value_and_grads(*args):
    def loss(*differentiable):
      out = gca_attention_pallas(*differentiable, args[-1], scale=0.125, config=config, interpret=False)
      return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=range(4))(*args[:-1])

  h100 = AbstractDevice("NVIDIA H100 80GB HBM3", None, "cuda")
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h100)):
    text = jax.jit(value_and_grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  triton = [name for name in ("gca_forward", "gca_backward_queries", "gca_backward_memory") if name in text]
  assert ("mosaic_gpu" in text) == mosaic
  assert triton == ([] if mosaic else ["gca_forward", "gca_backward_queries", "gca_backward_memory"])
