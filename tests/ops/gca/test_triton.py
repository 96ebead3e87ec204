"""GCA Pallas kernels in interpret mode (CPU): the same kernel code the GPU compiles.

Against the reference op (every retrieved chunk materialized, autodiff): outputs and the
gradients of q, chunk_k, chunk_v and chunk_weights under a random cotangent, in float32
(tight) and bf16 (loose), with grouped heads stacked into one tile and looped over,
plain heads, query chunks and memory chunks that are not a tile (padding), several
query blocks per chunk, duplicate retrievals (many query chunks picking one memory
chunk, one chunk twice in a slot list: the memory-side backward's sum), a memory chunk
nobody retrieves (zero gradient), an empty slot (weight 0; its weight still gets a
gradient) and an out-of-range index (clipped). Interpret mode starts outputs as NaN, so
an element a kernel never writes fails the comparison. Then: the default choice and its
fallback, bad configs, the shared-memory budget rule, and a lowering for an H100 on CPU
(Triton's shape limits).
"""

import functools

import jax
from jax.sharding import AbstractDevice, AbstractMesh
import jax.numpy as jnp
import pytest

from castle_jax.ops import backend
from castle_jax.ops.gca import gca_attention
from castle_jax.ops.gca.api import DEFAULT_ORDER, implementations
from helpers import rel_err
from ops.gca.base import random_inputs
from pallas_kernels.gca import GcaTritonConfig, default_triton_config, gca_attention_triton
from pallas_kernels.gca import triton_shared_memory
from pallas_kernels.gca.triton import config_for, tiling_for, unsupported_reason

pytestmark = pytest.mark.usefixtures("full_float32_matmuls")

GROUPED = dict(
  batch=2, query_chunks=3, query_len=5, heads=4, kv_heads=2, head_dim=16, memory_chunks=4, chunk_len=6, top_k=3
)


def _inputs(seed, *, dtype=jnp.float32, **shape):
  """`base.random_inputs` (every chunk index in range) and a float32 cotangent."""
  inputs = random_inputs(seed, dtype=dtype, indices_below=shape["memory_chunks"], **shape)
  return inputs, jax.random.normal(jax.random.key(seed + 1), inputs[0].shape, jnp.float32)


def _with_hard_retrievals(inputs):
  """Query chunk 0 holds one chunk twice and an empty last slot; every query chunk also reads
  memory chunk 1 (several query chunks, one chunk); the last memory chunk is never read."""
  q, chunk_k, chunk_v, weights, indices = inputs
  memory_chunks = chunk_k.shape[1]
  indices = indices % (memory_chunks - 1)
  indices = indices.at[:, 0, 1].set(indices[:, 0, 0]).at[:, :, 0].set(1)
  weights = weights.at[:, 0, -1].set(0.0)
  return q, chunk_k, chunk_v, weights, indices


def _value_and_grads(attention, inputs, cotangent):
  *differentiable, indices = inputs

  def loss(*args):
    return jnp.sum(attention(*args, indices).astype(jnp.float32) * cotangent)

  out = jax.jit(attention)(*inputs)
  return out, jax.jit(jax.grad(loss, argnums=range(4)))(*differentiable)


def _check_against_reference(inputs, cotangent, tol, config=None):
  pallas = functools.partial(gca_attention, implementation="triton", kernel_config=config)
  out, grads = _value_and_grads(pallas, inputs, cotangent)
  # The reference in float32 from the same (possibly bf16-rounded) inputs.
  inputs32 = tuple(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs)
  ref_out, ref_grads = _value_and_grads(
    functools.partial(gca_attention, implementation="reference"), inputs32, cotangent
  )
  assert out.dtype == inputs[0].dtype
  assert rel_err(out, ref_out) < tol, ("out", rel_err(out, ref_out))
  for name, grad, ref, x in zip(("q", "chunk_k", "chunk_v", "chunk_weights"), grads, ref_grads, inputs):
    assert grad.dtype == x.dtype and grad.shape == x.shape, name
    assert rel_err(grad, ref) < tol, (name, rel_err(grad, ref))
  return grads


def test_grouped_heads_stacked_in_one_tile_match_the_reference():
  inputs, cotangent = _inputs(0, **GROUPED)
  inputs = _with_hard_retrievals(inputs)
  # Rows of 5 queries pad to a 16-row block; the 2 heads of a kv head share one 32-row tile.
  assert tiling_for(5, 2, 6, GcaTritonConfig()).heads_per_program == 2
  grads = _check_against_reference(inputs, cotangent, 1e-5)
  assert float(jnp.max(jnp.abs(grads[1][:, -1]))) == 0.0  # the chunk nobody retrieved
  assert float(jnp.min(jnp.abs(grads[3][:, 0, -1]))) > 0.0  # the empty slot's weight still learns


def test_several_query_blocks_and_head_blocks_match_the_reference():
  # 36 rows per query chunk: a 32-row block, then a 16-row block for the last 4 (two launches);
  # one head per program, so the memory side loops over 2 heads per kv head; chunks exactly
  # one tile; k = 4 > 3 memory chunks, so chunks repeat within a slot list.
  shape = dict(
    batch=1, query_chunks=2, query_len=36, heads=4, kv_heads=2, head_dim=32, memory_chunks=3, chunk_len=16, top_k=4
  )
  config = GcaTritonConfig(block_rows=32, heads_per_program=1)
  assert tiling_for(36, 2, 16, config).segments == ((0, 32, 1), (32, 16, 1))
  inputs, cotangent = _inputs(1, **shape)
  _check_against_reference(inputs, cotangent, 1e-5, config)


def test_plain_heads_and_a_clipped_index_match_the_reference():
  shape = dict(
    batch=1, query_chunks=3, query_len=5, heads=3, kv_heads=3, head_dim=16, memory_chunks=2, chunk_len=6, top_k=2
  )
  inputs, cotangent = _inputs(2, **shape)
  q, chunk_k, chunk_v, weights, indices = inputs
  indices = indices.at[0, 1, 0].set(7)  # out of range: clipped to the last chunk, as the other paths do
  _check_against_reference((q, chunk_k, chunk_v, weights, indices), cotangent, 1e-5)


def test_bfloat16_matches_the_reference_loosely():
  inputs, cotangent = _inputs(3, **GROUPED, dtype=jnp.bfloat16)
  _check_against_reference(_with_hard_retrievals(inputs), cotangent, 2e-2)


def test_default_takes_pallas_on_a_gpu_and_falls_back_where_it_cannot_run(monkeypatch):
  def chosen(head_dim, chunk_len=6, dtype=jnp.float32, config=None):
    q = jax.ShapeDtypeStruct((1, 10, 4, head_dim), dtype)
    chunk_k = jax.ShapeDtypeStruct((1, 3, chunk_len, 2, head_dim), dtype)
    return backend.choose("gca_attention", None, implementations(q, chunk_k, config), DEFAULT_ORDER)

  assert chosen(16) == "xla"  # a default on the GPU only
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert chosen(16) == "triton"
  assert chosen(24) == "xla"  # not a power of two
  assert chosen(16, chunk_len=300) == "xla"  # more keys than one tile holds
  assert chosen(16, config=GcaTritonConfig(heads_per_program=4)) == "xla"  # 4 does not divide 2 heads per kv head
  assert chosen(256, chunk_len=256, dtype=jnp.bfloat16) == "xla"  # K and V tiles alone past the shared memory


def test_explicit_pallas_on_inputs_it_cannot_take_names_why():
  inputs, _ = _inputs(4, **{**GROUPED, "head_dim": 24})
  with pytest.raises(ValueError, match="power-of-two head_dim in \\[16, 256\\], got 24"):
    gca_attention(*inputs, implementation="triton")
  with pytest.raises(ValueError, match="power-of-two head_dim"):
    gca_attention_triton(*inputs, scale=1.0)


def _estimates(config, tiling, head_dim, dtype):
  return {
    kernel: triton_shared_memory.estimate(kernel, tiling, head_dim, dtype, getattr(config, field))
    for kernel, field in triton_shared_memory.STAGE_FIELDS.items()
  }


# 8 query heads on 2 kv heads, head dim 128, 64 tokens + a landmark = 65 rows per query chunk,
# 64-key memory chunks: an H100 refused the memory-side backward of the unfitted default in
# bf16 ("Shared memory size limit exceeded: requested 371204, available: 232448").
GROUPED_128 = dict(query_len=65, group=4, chunk_len=64, head_dim=128, dtype=jnp.bfloat16)
REFUSED_BYTES = 371204


def test_default_config_fits_grouped_heads_at_head_dim_128_under_the_budget():
  unfitted = default_triton_config()
  tiling = tiling_for(65, 4, 64, unfitted)
  memory_side = triton_shared_memory.estimate("backward_memory", tiling, 128, jnp.bfloat16, unfitted.memory_num_stages)
  assert abs(memory_side - REFUSED_BYTES) < 16 * 1024  # the estimate tracks what the GPU was asked for
  config, fitted_tiling = config_for(None, **GROUPED_128)
  assert fitted_tiling == tiling
  assert config.memory_num_stages == 1  # the pipelined per-pair tiles were what did not fit
  assert (config.num_stages, config.bwd_num_stages) == (2, 2)  # the others fit as they were
  assert max(_estimates(config, tiling, 128, jnp.bfloat16).values()) <= triton_shared_memory.SHARED_MEMORY_BUDGET
  assert unsupported_reason(heads=8, kv_heads=2, head_dim=128, chunk_len=64, dtype=jnp.bfloat16, query_len=65) is None


def test_default_config_keeps_the_drt_shape_as_it_is():
  # drt_128m: 12 heads x 64, 64-row query chunks, 63-key memory chunks (its speed was measured with these).
  for dtype in (jnp.bfloat16, jnp.float32):
    config, tiling = config_for(None, query_len=64, group=1, chunk_len=63, head_dim=64, dtype=dtype)
    assert config == GcaTritonConfig() == default_triton_config()
    assert (tiling.block_q, tiling.heads_per_program, tiling.padded_chunk_len, tiling.segments) == (
      64,
      1,
      64,
      ((0, 64, 1),),
    )


def test_explicit_config_over_the_budget_names_the_field():
  over = dict(heads=8, kv_heads=2, head_dim=128, chunk_len=64, dtype=jnp.bfloat16)
  reason = unsupported_reason(**over, config=GcaTritonConfig(), query_len=65)
  assert "backward_memory kernel would ask for about 368 KiB" in reason
  assert "GcaTritonConfig.memory_num_stages=1" in reason
  assert unsupported_reason(**over, config=GcaTritonConfig(memory_num_stages=1), query_len=65) is None
  # Chunks and head dims whose K and V tiles alone pass the budget: no config helps.
  reason = unsupported_reason(**{**over, "head_dim": 256, "chunk_len": 256}, config=GcaTritonConfig(num_stages=1))
  assert "forward kernel" in reason and "no tiles fit" in reason
  chunks = jax.ShapeDtypeStruct((1, 2, 64, 2, 128), jnp.bfloat16)
  slots = (jax.ShapeDtypeStruct((1, 2, 1), jnp.float32), jax.ShapeDtypeStruct((1, 2, 1), jnp.int32))
  with pytest.raises(ValueError, match="memory_num_stages=2"):
    jax.eval_shape(
      functools.partial(gca_attention_triton, scale=1.0, config=GcaTritonConfig()),
      jax.ShapeDtypeStruct((1, 130, 8, 128), jnp.bfloat16),
      chunks,
      chunks,
      *slots,
    )


@pytest.mark.parametrize(
  "text, message",
  [
    ("block_rows=24", "block_rows must be a power of two"),
    ("block_rows=8", "block_rows must be >= 16"),
    ("heads_per_program=3", "heads_per_program must be a power of two"),
    ("num_warps=0", "num_warps must be an int >= 1"),
    ("block_q=16", "has no key 'block_q'"),
  ],
)
def test_bad_configs_name_the_field(text, message):
  with pytest.raises(ValueError, match=message):
    GcaTritonConfig.from_string(text)


@pytest.mark.parametrize(
  "shape, dtype, config",
  [
    # drt_128m: 12 heads x 64, query chunks of 63 tokens + a landmark, memory chunks of 63 keys, k = 8.
    (
      dict(
        batch=1,
        query_chunks=4,
        query_len=64,
        heads=12,
        kv_heads=12,
        head_dim=64,
        memory_chunks=4,
        chunk_len=63,
        top_k=8,
      ),
      jnp.bfloat16,
      None,
    ),
    (GROUPED, jnp.float32, None),
    # The benchmark's layout: 64 tokens + a landmark = 65 rows, run as 64 + 16.
    (
      dict(
        batch=1, query_chunks=2, query_len=65, heads=4, kv_heads=4, head_dim=64, memory_chunks=2, chunk_len=64, top_k=2
      ),
      jnp.bfloat16,
      None,
    ),
    (
      dict(
        batch=1,
        query_chunks=2,
        query_len=20,
        heads=8,
        kv_heads=2,
        head_dim=128,
        memory_chunks=3,
        chunk_len=200,
        top_k=3,
      ),
      jnp.float16,
      GcaTritonConfig(block_rows=32, heads_per_program=2, num_stages=1, bwd_num_stages=1, memory_num_stages=1),
    ),
  ],
)
def test_kernels_lower_for_an_h100(shape, dtype, config):
  """Triton's limits (power-of-two tiles, 2-D products) apply when lowering for CUDA, which
  runs on CPU; interpret mode does not check them."""
  inputs, _ = _inputs(5, **shape, dtype=dtype)
  *differentiable, indices = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs)

  def value_and_grads(*args):
    def loss(*args):
      out = gca_attention_triton(*args, scale=0.125, config=config, interpret=False)
      return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=range(4))(*args)

  h100 = AbstractDevice("NVIDIA H100 80GB HBM3", None, "cuda")
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=h100)):
    lowered = jax.jit(value_and_grads).trace(*differentiable, indices).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  for kernel in ("gca_forward", "gca_backward_queries", "gca_backward_memory"):
    assert kernel in text, kernel
