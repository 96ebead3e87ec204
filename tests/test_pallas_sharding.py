"""Pallas kernels under a device mesh (8 fake CPU devices, interpret mode).

XLA cannot partition a Pallas custom call, so the ops run the kernels per shard with
`jax.shard_map` when a mesh is set: every device computes its own batch rows and
heads. Checked: the sharded results equal the unsharded ones (outputs, gradients,
decoding outputs and caches), the kernels sit inside a shard_map, and a batch that
does not divide over the mesh is a clear error.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

from castle_jax.ops.castle import castle_attention, decode_step, init_cache, prefill
from castle_jax.sharding import SEQUENCE_HEADS_AXES, map_over_shards
from helpers import rel_err
from pallas_kernels.castle import CastleDecodeConfig, CastleTritonConfig

SHAPE = (4, 24, 2, 16)  # batch over data x fsdp = 2 x 2, heads over tensor = 2
KERNELS = CastleTritonConfig(block_q=16, block_k=16, bwd_block_q=16, bwd_block_k=16)
HEADS_SPEC = P(("data", "fsdp"), None, "tensor", None)


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _mesh():
  return jax.make_mesh(
    (2, 2, 2), ("data", "fsdp", "tensor"), devices=jax.devices()[:8], axis_types=(jax.sharding.AxisType.Auto,) * 3
  )


def _inputs(seed, shape=SHAPE):
  keys = jax.random.split(jax.random.key(seed), 7)
  return tuple(jax.random.normal(k, shape, jnp.float32) for k in keys[:6]), jax.random.normal(keys[6], shape)


def _attention_and_grads(inputs, cotangent):
  def loss(*args):
    return jnp.sum(castle_attention(*args, window=5, implementation="triton", kernel_config=KERNELS) * cotangent)

  out = castle_attention(*inputs, window=5, implementation="triton", kernel_config=KERNELS)
  return out, jax.grad(loss, argnums=range(6))(*inputs)


def test_castle_kernels_run_per_shard_and_match_unsharded():
  inputs, cotangent = _inputs(seed=0)
  expected, expected_grads = jax.jit(_attention_and_grads)(inputs, cotangent)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    sharded = jax.device_put((inputs, cotangent), NamedSharding(mesh, HEADS_SPEC))
    assert "shard_map" in str(jax.make_jaxpr(_attention_and_grads)(*sharded))
    out, grads = jax.jit(_attention_and_grads)(*sharded)
  assert out.sharding.spec == HEADS_SPEC
  assert rel_err(out, expected) < 1e-6
  for g, eg in zip(grads, expected_grads):
    assert rel_err(g, eg) < 1e-6


@pytest.mark.parametrize("window", [None, 3])
def test_pallas_prefill_and_decoding_per_shard(window):
  inputs, _ = _inputs(seed=1)
  batch, seq, heads, head_dim = SHAPE
  step = jax.jit(
    lambda c, *a: decode_step(c, *a, implementation="triton", kernel_config=CastleDecodeConfig(block_rows=16, splits=2))
  )
  fill = jax.jit(lambda c, *a: prefill(c, *a, implementation="triton"))

  def run(inputs):
    cache = init_cache(batch, seq, heads, head_dim, jnp.float32, window=window)
    outs, cache = fill(cache, *(x[:, :20] for x in inputs))
    for t in range(20, seq):
      out, cache = step(cache, *(x[:, t : t + 1] for x in inputs))
      outs = jnp.concatenate([outs, out], axis=1)
    return outs, cache

  expected, expected_cache = run(inputs)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    token = tuple(x[:, :1] for x in inputs)
    cache = init_cache(batch, seq, heads, head_dim, jnp.float32, window=window)
    assert "shard_map" in str(jax.make_jaxpr(step)(cache, *token))
    outs, cache = run(jax.device_put(inputs, NamedSharding(mesh, HEADS_SPEC)))
  assert rel_err(outs, expected) < 1e-6
  assert rel_err(cache.lookahead_keys, expected_cache.lookahead_keys) < 1e-6


def test_batch_that_does_not_divide_names_the_fix():
  inputs, _ = _inputs(seed=2, shape=(3, 16, 2, 16))
  with jax.set_mesh(_mesh()):
    with pytest.raises(ValueError, match=r"castle_attention: argument 0 .* multiple of 4.*batch size"):
      castle_attention(*inputs, implementation="triton", kernel_config=KERNELS)


def test_without_a_mesh_nothing_is_wrapped():
  x = jnp.ones((2, 4, 2, 16))
  text = str(
    jax.make_jaxpr(lambda y: map_over_shards(jnp.sin, (y,), [SEQUENCE_HEADS_AXES], SEQUENCE_HEADS_AXES, what="sin"))(x)
  )
  assert "shard_map" not in text


def test_power_kernels_run_per_shard_with_states():
  """Grouped heads (4 query heads on 2 key/value heads) split over tensor = 2, with an
  initial state and the final state."""
  from castle_jax.ops.power import PowerState, power_attention

  rng = jax.random.split(jax.random.key(3), 6)
  batch, seq, heads, kv_heads, dim = 4, 128, 4, 2, 16
  q = jax.random.normal(rng[0], (batch, seq, heads, dim))
  k = jax.random.normal(rng[1], (batch, seq, kv_heads, dim))
  v = jax.random.normal(rng[2], (batch, seq, kv_heads, dim))
  log_g = -jax.nn.softplus(-2.0 - jax.random.normal(rng[3], (batch, seq, kv_heads)))
  _, state = power_attention(q, k, v, log_g, implementation="reference", return_final_state=True)

  def run(q, k, v, log_g, state):
    out, final = power_attention(
      q, k, v, log_g, implementation="triton", chunk_size=64, initial_state=state, return_final_state=True
    )
    return jnp.sum(out * out), (out, final)

  (_, (expected, expected_state)), expected_grads = jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2), has_aux=True))(
    q, k, v, log_g, state
  )
  mesh = _mesh()
  with jax.set_mesh(mesh):
    heads_sharding = NamedSharding(mesh, HEADS_SPEC)
    args = (
      *jax.device_put((q, k, v), heads_sharding),
      jax.device_put(log_g, NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))),
      jax.device_put(state, NamedSharding(mesh, P(("data", "fsdp"), "tensor"))),
    )
    grad_fn = jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2), has_aux=True))
    assert "shard_map" in str(jax.make_jaxpr(grad_fn)(*args))
    (_, (out, final)), grads = grad_fn(*args)
  assert isinstance(final, PowerState)
  assert rel_err(out, expected) < 1e-5
  assert rel_err(final.state, expected_state.state) < 1e-5
  for g, eg in zip(grads, expected_grads):
    assert rel_err(g, eg) < 1e-5


def test_gca_kernels_run_per_shard():
  """Grouped heads (4 query heads on 2 key/value heads) split over tensor = 2; chunk weights
  and indices split over the batch only."""
  from castle_jax.ops.gca import gca_attention

  rng = jax.random.split(jax.random.key(4), 6)
  batch, query_chunks, query_len, heads, kv_heads, dim, memory_chunks, chunk_len, top_k = 4, 2, 5, 4, 2, 16, 3, 6, 2
  q = jax.random.normal(rng[0], (batch, query_chunks * query_len, heads, dim))
  chunk_k = jax.random.normal(rng[1], (batch, memory_chunks, chunk_len, kv_heads, dim))
  chunk_v = jax.random.normal(rng[2], (batch, memory_chunks, chunk_len, kv_heads, dim))
  weights = jax.nn.softmax(jax.random.normal(rng[3], (batch, query_chunks, top_k)), axis=-1)
  indices = jax.random.randint(rng[4], (batch, query_chunks, top_k), 0, memory_chunks)

  def run(q, chunk_k, chunk_v, weights, indices):
    out = gca_attention(q, chunk_k, chunk_v, weights, indices, implementation="triton")
    return jnp.sum(out * out), out

  grad_fn = jax.jit(jax.value_and_grad(run, argnums=range(4), has_aux=True))
  (_, expected), expected_grads = grad_fn(q, chunk_k, chunk_v, weights, indices)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    memory_sharding = NamedSharding(mesh, P(("data", "fsdp"), None, None, "tensor", None))
    slot_sharding = NamedSharding(mesh, P(("data", "fsdp"), None, None))
    args = (
      jax.device_put(q, NamedSharding(mesh, HEADS_SPEC)),
      *jax.device_put((chunk_k, chunk_v), memory_sharding),
      *jax.device_put((weights, indices), slot_sharding),
    )
    assert "shard_map" in str(jax.make_jaxpr(grad_fn)(*args))
    (_, out), grads = grad_fn(*args)
  assert rel_err(out, expected) < 1e-5
  for g, eg in zip(grads, expected_grads):
    assert rel_err(g, eg) < 1e-5


def test_tree_attention_kernel_runs_per_shard():
  """Batch rows over data x fsdp with their own lengths and trees, grouped heads (4 query
  heads on 2 key/value heads) over tensor = 2."""
  from castle_jax.ops.tree_attention import tree_attention
  from ops.tree_attention.base import make_inputs

  inputs = make_inputs(8, batch=4, n=5, heads=4, kv_heads=2, head_dim=16, capacity=40, cache_length=[0, 40, 17, 3])
  run = jax.jit(lambda **kw: tree_attention(**kw, implementation="triton", return_lse=True))
  expected = run(**inputs)
  mesh = _mesh()
  with jax.set_mesh(mesh):
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    sharded = {
      **inputs,
      "q": jax.device_put(inputs["q"], NamedSharding(mesh, HEADS_SPEC)),
      **{
        name: jax.device_put(inputs[name], NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None)))
        for name in ("cache_k", "cache_v", "tree_k", "tree_v")
      },
      "cache_length": jax.device_put(inputs["cache_length"], rows),
      "tree_mask": jax.device_put(inputs["tree_mask"], NamedSharding(mesh, P(("data", "fsdp"), None, None))),
    }
    assert "shard_map" in str(jax.make_jaxpr(run)(**sharded))
    out, lse = run(**sharded)
  assert rel_err(out, expected[0]) < 1e-6
  np.testing.assert_allclose(np.asarray(lse), np.asarray(expected[1]), rtol=1e-6)
