"""Train state created directly sharded: shapes from `jax.eval_shape`, shardings
from the parameters' logical axis names, values from a jitted init."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from castle_jax.models import family_of
from castle_jax.sharding import LOGICAL_AXIS_RULES, check_params_divisible


@flax.struct.dataclass
class TrainState:
  """step: int32 scalar; params: the model's "params" collection; opt_state: optax state."""

  step: jax.Array
  params: Any
  opt_state: Any


def _boxed_init(model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array, seq_len: int):
  params = family_of(model).init_variables(model, rng, seq_len)["params"]
  # optax maps over the boxed leaves, so the optimizer state keeps the axis names too.
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def state_shardings(
  model: nn.Module, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh, seq_len: int
) -> tuple[TrainState, TrainState]:
  """(abstract state: ShapeDtypeStructs with shardings, the NamedShardings tree)."""
  with jax.set_mesh(None):  # see init_train_state
    boxed = jax.eval_shape(lambda r: _boxed_init(model, tx, r, seq_len), jax.random.key(0))
  specs = nn.get_partition_spec(boxed)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, LOGICAL_AXIS_RULES)
  abstract = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), _strip_boxes(boxed), shardings
  )
  _check_divisible(abstract)
  return abstract, shardings


def _strip_boxes(tree):
  """Replaces logical-axis boxes by their values (nn.unbox would also constrain them)."""
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
  return jax.tree.map(lambda x: x.unbox(apply_constraint=False) if is_box(x) else x, tree, is_leaf=is_box)


def _check_divisible(abstract: TrainState) -> None:
  """Raises a clear error when a parameter dimension cannot be split over its mesh axes."""
  check_params_divisible(
    abstract.params, "Change the model sizes (e.g. model.n_heads, model.vocab_size) or the mesh (config.mesh)."
  )


def init_train_state(
  model: nn.Module, tx: optax.GradientTransformation, rng: jax.Array, seq_len: int, shardings: TrainState
) -> TrainState:
  """Initializes parameters and optimizer state directly into their shardings.

  The model's init runs a forward pass on one [1, seq_len] sequence only to create the
  parameters; it runs with no mesh set, since under a data-parallel mesh the attention
  ops that split their batch over the mesh (`map_over_shards`) would reject a batch of 1.
  The parameters still land in `shardings`."""
  init = jax.jit(lambda r: nn.unbox(_boxed_init(model, tx, r, seq_len)), out_shardings=shardings)
  with jax.set_mesh(None):
    return init(rng)


# --- a state of several seeds, stacked along a leading seed axis (`train.seeds`) ---------------------


def with_seed_axis(shardings: Any) -> Any:
  """The shardings of arrays stacked along a new leading seed axis: that axis unsharded,
  the others as in `shardings` (NamedShardings)."""
  return jax.tree.map(
    lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.spec)), shardings
  )


def stack_states(states: list[TrainState], shardings: TrainState) -> TrainState:
  """The seeds' states (each in `shardings`) stacked along a leading seed axis."""
  stack = jax.jit(
    lambda *each: jax.tree.map(lambda *leaves: jnp.stack(leaves), *each), out_shardings=with_seed_axis(shardings)
  )
  return stack(*states)


def seed_state_getter(shardings: TrainState):
  """(stacked state, k) -> seed k's state, in `shardings` (one run's): what its checkpoint holds."""
  take = jax.jit(lambda state, index: jax.tree.map(lambda x: x[index], state), out_shardings=shardings)
  return lambda state, index: take(state, jnp.int32(index))
