"""The sharded train step on 8 fake CPU devices equals the single-device step."""

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from castle_jax.models import ModelConfig, TransformerLM
from castle_jax.sharding import LOGICAL_AXIS_RULES
from helpers import rel_err
from train.config import base_config
from castle_jax.sharding import resolve_mesh_shape
from train.mesh import make_mesh
from train.optimizer import make_optimizer
from train.state import init_train_state, state_shardings
from train.step import jit_train_step

# Its module-scoped fixtures are costly (trained models, compiled steps): one worker runs the
# whole module under `--dist loadgroup`, so they are built once.
pytestmark = pytest.mark.xdist_group("test_sharding")

MODEL = ModelConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, dtype="float32")
SEQ, BATCH = 16, 16


def _run_steps(mesh_sizes, devices, grad_accum_steps=1, steps=2):
  mesh_cfg = ml_collections.ConfigDict(dict(zip(("data", "fsdp", "tensor"), mesh_sizes)))
  mesh = make_mesh(mesh_cfg, devices)
  train_cfg = base_config().train
  train_cfg.steps, train_cfg.warmup_steps, train_cfg.learning_rate = 10, 2, 1e-2
  tx, schedule = make_optimizer(train_cfg)
  model = TransformerLM(MODEL)
  batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    _, shardings = state_shardings(model, tx, mesh, SEQ)
    state = init_train_state(model, tx, jax.random.key(0), SEQ, shardings)
    step = jit_train_step(
      model=model,
      tx=tx,
      schedule=schedule,
      pad_id=-1,
      grad_accum_steps=grad_accum_steps,
      state_shardings=shardings,
      batch_sharding=batch_sharding,
    )
    losses = []
    for i in range(steps):
      tokens = jax.random.randint(jax.random.key(100 + i), (BATCH, SEQ + 1), 0, 128)
      batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
      state, metrics = step(state, jax.device_put(batch, batch_sharding))
      losses.append(float(metrics["loss"]))
  return losses, jax.device_get(state.params), state


@pytest.fixture(scope="module")
def single_device_run():
  return _run_steps((1, 1, 1), jax.devices()[:1])


@pytest.mark.parametrize("mesh_sizes, accum", [((8, 1, 1), 1), ((2, 2, 2), 1), ((1, 8, 1), 1), ((2, 2, 2), 2)])
def test_sharded_step_matches_single_device(single_device_run, mesh_sizes, accum):
  assert len(jax.devices()) == 8
  ref_losses, ref_params, _ = single_device_run
  losses, params, state = _run_steps(mesh_sizes, jax.devices(), grad_accum_steps=accum)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert ref_losses[1] != ref_losses[0]  # the update did something
  for p, rp in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    assert rel_err(p, rp) < 1e-5
  # Parameters really are sharded as the rules say.
  query_kernel = state.params["block_0"]["attention"]["query"]["kernel"]
  assert query_kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  shard_shape = query_kernel.addressable_shards[0].data.shape
  assert shard_shape == (64 // mesh_sizes[1], 4 // mesh_sizes[2], 16)


@pytest.mark.parametrize(
  "sizes, devices, match",
  [
    ((3, 1, 1), 8, "does not divide"),
    ((-1, -1, 1), 8, "At most one"),
    ((0, 1, 1), 8, ">= 1 or -1"),
    ((2, 2, 1), 8, "uses 4 devices but 8"),
  ],
)
def test_bad_mesh_shapes(sizes, devices, match):
  with pytest.raises(ValueError, match=match):
    resolve_mesh_shape(sizes, devices)


def test_mesh_fill():
  assert resolve_mesh_shape((-1, 2, 2), 8) == (2, 2, 2)
  assert resolve_mesh_shape((1, -1, 1), 8) == (1, 8, 1)


def test_unshardable_parameter_is_reported():
  mesh = make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=8)))
  model = TransformerLM(MODEL)  # 2 kv heads cannot be split 8 ways
  tx, _ = make_optimizer(base_config().train)
  with pytest.raises(ValueError, match=r"cannot be sharded.*kv_heads|cannot be sharded"):
    state_shardings(model, tx, mesh, SEQ)


@pytest.mark.parametrize("attention, kwargs", [("castle", ()), ("power", (("p", 2), ("chunk_size", 64)))])
def test_kernel_models_start_on_a_data_parallel_mesh(attention, kwargs):
  """The init's forward pass sees one sequence; the Pallas ops split the batch over the
  mesh and would reject it, so the parameters are created with no mesh set."""
  config = ModelConfig(
    vocab_size=128,
    d_model=32,
    n_layers=1,
    n_heads=2,
    head_dim=16,
    attention=attention,
    attention_impl="triton",
    attention_kwargs=kwargs,
    dtype="float32",
  )
  mesh = make_mesh(ml_collections.ConfigDict(dict(data=8, fsdp=1, tensor=1)))
  model = TransformerLM(config)
  tx, _ = make_optimizer(base_config().train)
  with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    _, shardings = state_shardings(model, tx, mesh, SEQ)
    state = init_train_state(model, tx, jax.random.key(0), SEQ, shardings)
  assert all(leaf.sharding.mesh.shape["data"] == 8 for leaf in jax.tree.leaves(state.params))
