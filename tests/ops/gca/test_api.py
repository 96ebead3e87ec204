"""How GCA picks its implementation: "reference", "xla", "triton" or "mosaic", or None for
the fastest that runs here (`castle_jax.ops.gca.api`).

The default with the device faked (a Hopper GPU runs Mosaic where its kernels take the
inputs, other GPUs and CPUs do not; the Mosaic kernels accept sizes only they take); an
explicit "mosaic" that cannot run raises naming why; and runs through
`castle_jax.ops.gca.gca_attention(implementation="mosaic")` in GPU interpret mode, with the
Mosaic kernels spied on and the Triton kernels made to fail; and the compiled (not
interpreted) default lowered for an H100, where Hopper holds only Mosaic kernels.
`test_implementations.py` checks every implementation's numbers.
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh
import jax.numpy as jnp
import pytest

from castle_jax.ops import backend
from castle_jax.ops.gca import api, gca_attention
from pallas_kernels.gca import GcaMosaicConfig, GcaTritonConfig, triton_kernels, mosaic
from pallas_kernels.gca.triton import unsupported_reason
from helpers import AMPERE, HOPPER, rel_err
from ops.gca.base import CASES, gca_inputs, small_inputs

# drt_128m's per-head sizes: head dim 64, 64-row query chunks, 63-key memory chunks, k = 8.
DRT = dict(dtype=jnp.bfloat16, head_dim=64, chunk_len=63, query_len=64, heads=12, kv_heads=12, top_k=8)


def _choose(requested=None, kernel_config=None, **changes):
  sizes = dict(DRT, **changes)
  q = jax.ShapeDtypeStruct((1, 2 * sizes["query_len"], sizes["heads"], sizes["head_dim"]), sizes["dtype"])
  chunk_k = jax.ShapeDtypeStruct((1, 3, sizes["chunk_len"], sizes["kv_heads"], sizes["head_dim"]), sizes["dtype"])
  table = api.implementations(q, chunk_k, kernel_config, 2, sizes["top_k"])
  return backend.choose("gca_attention", requested, table, api.DEFAULT_ORDER, kernel_config=kernel_config)


def test_configs_validate_and_parse():
  assert GcaMosaicConfig().stages == 2
  assert GcaMosaicConfig.from_string("stages=3") == GcaMosaicConfig(stages=3)
  with pytest.raises(ValueError, match="GcaMosaicConfig.stages must be an int >= 1, got 0"):
    GcaMosaicConfig(stages=0)
  with pytest.raises(ValueError, match="GcaTritonConfig has no key 'backend'"):
    GcaTritonConfig.from_string("backend=mosaic")


def test_the_default_runs_mosaic_on_hopper_where_it_takes_the_inputs(device):
  device(HOPPER)
  assert _choose() == "mosaic"
  assert _choose(dtype=jnp.float16, head_dim=128, chunk_len=64, query_len=65, heads=8, kv_heads=2) == "mosaic"
  assert _choose("triton") == "triton"  # an explicit choice is not overridden
  assert _choose(kernel_config=GcaTritonConfig()) == "triton"  # nor is the config's implementation
  for changes in (dict(dtype=jnp.float32), dict(head_dim=32), dict(chunk_len=65)):
    assert _choose(**changes) == "triton", changes
  # Mosaic past its shared memory; the config configures no other kernels.
  assert _choose(kernel_config=GcaMosaicConfig(stages=20)) == "xla"


def test_the_default_on_hopper_accepts_what_only_the_mosaic_kernels_take(device):
  """Grouped heads of 128: past the Triton memory-side kernel's shared memory, within the
  Mosaic kernels'."""
  sizes = dict(head_dim=128, chunk_len=64, heads=8, kv_heads=2, dtype=jnp.bfloat16, query_len=65, top_k=4)
  explicit = GcaTritonConfig()  # run as given: the Triton stages are not lowered to fit
  assert "shared memory" in unsupported_reason(**{k: v for k, v in sizes.items() if k != "top_k"}, config=explicit)
  device(HOPPER)
  assert _choose(**sizes) == "mosaic"
  device(AMPERE)  # the Triton kernels alone cannot take it
  assert _choose(**sizes, kernel_config=explicit) == "xla"
  with pytest.raises(ValueError, match="implementation='triton' cannot run: .*shared memory"):
    _choose("triton", **sizes, kernel_config=explicit)


def test_the_default_off_hopper_is_triton(device):
  for capability in (AMPERE, "10.0", None):
    device(capability)
    assert _choose() == "triton", capability


@pytest.mark.parametrize(
  "changes, message",
  [
    (dict(dtype=jnp.float32), "got dtype float32; cast q, chunk_k and chunk_v or use the Triton kernels"),
    (dict(head_dim=256), r"head_dim in \(64, 128\)"),
    (dict(chunk_len=128), "memory chunks of 1..64 keys"),
    (dict(head_dim=128, kernel_config=GcaMosaicConfig(stages=20)), "stages=20 asks for about .* KiB of shared memory"),
  ],
)
def test_explicit_mosaic_names_why_it_cannot_run(device, changes, message):
  device(HOPPER)
  with pytest.raises(ValueError, match=f"gca_attention: implementation='mosaic' cannot run: .*{message}"):
    _choose("mosaic", **changes)


def test_explicit_mosaic_needs_hopper_unless_interpreted(device):
  assert _choose("mosaic") == "mosaic"  # interpret mode on this CPU
  device(AMPERE)
  with pytest.raises(
    ValueError,
    match=r"need a Hopper GPU \(compute capability 9.x\), this is compute capability 8.0; use implementation='triton'",
  ):
    _choose("mosaic")
  assert _choose("triton") == "triton"


def test_explicit_mosaic_through_the_entry_point_raises_for_what_it_cannot_take():
  sizes = dict(heads=2, kv_heads=2, head_dim=32, chunk_len=63, dtype=jnp.bfloat16)
  inputs = gca_inputs(0, batch=1, query_chunks=2, query_len=8, memory_chunks=3, top_k=2, **sizes)
  with pytest.raises(ValueError, match=r"head_dim in \(64, 128\)"):
    gca_attention(*inputs, implementation="mosaic")
  with pytest.raises(ValueError, match=r"^gca_attention: implementation='pallas' is now 'triton' or 'mosaic'"):
    gca_attention(*inputs, implementation="pallas")
  with pytest.raises(ValueError, match=r"must be a GcaMosaicConfig \(or None\), got a GcaTritonConfig"):
    gca_attention(*inputs, implementation="mosaic", kernel_config=GcaTritonConfig())


@pytest.fixture
def spied_kernels(monkeypatch):
  """Counts the Mosaic kernels' calls (by name) and makes any Triton kernel call fail."""
  calls = []
  for name in ("forward_native", "backward_queries_native", "backward_memory_native"):

    def spy(*args, _name=name, _kernel=getattr(mosaic, name), **kwargs):
      calls.append(_name)
      return _kernel(*args, **kwargs)

    monkeypatch.setattr(mosaic, name, spy)
  for name in ("forward", "backward_queries", "backward_memory"):

    def refuse(*args, _name=name, **kwargs):
      raise AssertionError(f"the Triton kernel {_name} ran")

    monkeypatch.setattr(triton_kernels, name, refuse)
  return calls


def test_mosaic_runs_its_kernels_alone(spied_kernels):
  """implementation="mosaic" in interpret mode on CPU runs the three Mosaic kernels and no
  Triton one (its numbers: test_implementations.py). That the default picks the same kernels
  on a Hopper GPU is checked without running them (the lowering test below)."""
  inputs = gca_inputs(0, **CASES["drt"], dtype=jnp.bfloat16)
  *differentiable, indices = inputs
  loss = lambda *a: jnp.sum(gca_attention(*a, indices, implementation="mosaic").astype(jnp.float32))
  jax.block_until_ready(jax.grad(loss, argnums=range(4))(*differentiable))
  assert sorted(set(spied_kernels)) == ["backward_memory_native", "backward_queries_native", "forward_native"]


@pytest.mark.parametrize(
  "implementation, capability, runs_mosaic", [(None, HOPPER, True), ("triton", HOPPER, False), (None, AMPERE, False)]
)
def test_value_and_gradients_lower_for_an_h100(device, implementation, capability, runs_mosaic):
  device(capability)
  struct = jax.ShapeDtypeStruct
  memory = struct((1, 4, 63, 12, 64), jnp.bfloat16)
  args = (
    struct((1, 4 * 64, 12, 64), jnp.bfloat16),
    memory,
    memory,
    struct((1, 4, 8), jnp.float32),
    struct((1, 4, 8), jnp.int32),
  )

  def value_and_grads(*args):
    def loss(*differentiable):
      return jnp.sum(gca_attention(*differentiable, args[-1], implementation=implementation).astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=range(4))(*args[:-1])

  h100 = AbstractDevice("NVIDIA H100 80GB HBM3", None, "cuda")
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h100)):
    text = jax.jit(value_and_grads).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  triton = [name for name in ("gca_forward", "gca_backward_queries", "gca_backward_memory") if name in text]
  assert ("mosaic_gpu" in text) == runs_mosaic
  assert triton == ([] if runs_mosaic else ["gca_forward", "gca_backward_queries", "gca_backward_memory"])


def test_entry_point_implementations_agree_and_reject_unknown():
  inputs = small_inputs(5)
  assert rel_err(gca_attention(*inputs), gca_attention(*inputs, implementation="reference")) < 1e-5
  with pytest.raises(ValueError, match="gca_attention: unknown implementation 'cudnn'"):
    gca_attention(*inputs, implementation="cudnn")
  # head_dim 8: the default skips the kernels, an explicit "triton" names why (tests/ops/gca/test_triton.py).
  with pytest.raises(ValueError, match="implementation='triton' cannot run: .*power-of-two head_dim"):
    gca_attention(*inputs, implementation="triton")


@pytest.mark.parametrize(
  "change, message",
  [
    (lambda a: (a[0][:, :-1], *a[1:]), "multiple of the query chunks"),
    (lambda a: (a[0], a[1][..., :4], a[2][..., :4], *a[3:]), "head_dim"),
    (lambda a: (a[0], a[1], a[2][:, :2], *a[3:]), "same shape"),
    (lambda a: (*a[:3], a[3][..., :2], a[4]), "chunk_weights"),
    (lambda a: (*a[:4], a[4].astype(jnp.float32)), "must be integers"),
    (lambda a: (a[0][..., :3, :], *a[1:]), "multiple of chunk_k/chunk_v kv_heads"),
    (lambda a: (*a[:3], a[3][..., :0], a[4][..., :0]), "k >= 1"),
  ],
)
def test_bad_inputs_name_the_argument(change, message):
  with pytest.raises(ValueError, match=message):
    gca_attention(*change(small_inputs(6)))
