"""The model-family table, next to the attention table: one entry per `model.family`.

The trainer (`train/`) and `castle_jax.inference.generate` reach a model only through
its family, so a new kind of model (DRT: lower and upper layers, a chunk encoder and
landmark tokens; LongSpec's draft: cross-attention over another model's KV cache)
trains through `python -m train` and decodes through `generate()` by adding one entry
here, with no special case in either.

A family's module is a Flax module built from a ModelConfig and called as
  `module.apply({"params": params}, tokens, positions=None, caches=None)
      -> (logits float32 [batch, seq, vocab], caches or None)`,
with `module.init_cache(batch, capacity)` giving its decoding caches (a pytree,
explicit so it can be sharded or kept in host memory). Everything else the trainer
and generate() need is a function of the family.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.config import ModelConfig
from castle_jax.models import drt, drt_decoding, longspec_draft, transformer
from castle_jax.models.frozen import FrozenSource
from castle_jax.sharding import LOGICAL_AXIS_RULES


def _init_variables(module: nn.Module, rng: jax.Array, seq_len: int):
  """The module's variables (boxed with logical axis names) for [1, seq_len] tokens."""
  return module.init(rng, jnp.zeros((1, seq_len), jnp.int32))


def _init_cache(module: nn.Module, batch: int, capacity: int) -> Any:
  return module.init_cache(batch, capacity)


def _decode(module: nn.Module, params: Any, tokens: jax.Array, positions: jax.Array, caches: Any):
  return module.apply({"params": params}, tokens, positions, caches)


# Compiled once per (module, count, shapes): evaluation scores many batches of one shape, and an
# op-by-op forward pass (a CASTLE model's above all) is far slower than its compiled program.
@functools.partial(jax.jit, static_argnums=(0, 3))
def _last_logits(module: nn.Module, params: Any, tokens: jax.Array, count: int) -> jax.Array:
  """The teacher-forced forward pass over the whole sequence, its last `count` positions kept."""
  logits, _ = module.apply({"params": params}, tokens)
  return logits[:, tokens.shape[1] - count :]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """What the trainer and generate() need from a kind of model.

  Attributes:
    name: the config name (`model.family`).
    build: ModelConfig -> the Flax module.
    init_variables: (module, rng, seq_len) -> variables ({"params": ...}, boxed with
      logical axis names), traced under `jax.eval_shape` for the sharded train state.
    token_losses: (module, params, batch, pad_id, rng) -> (loss float32 [B, T], weights
      float32 [B, T]): the per-token loss already multiplied by the weights, and the
      weights (which tokens count: 0 at padding; a family may also zero landmark or
      draft-only positions). rng: a PRNG key in training (for models that draw noise,
      e.g. DRT's Gumbel top-k), None in evaluation. The trainer averages sum(loss) / sum(weights).
    init_cache: (module, batch, capacity) -> the decoding caches, or None for a family
      that decodes through `stream_decoder` instead.
    decode: (module, params, tokens [B, n], positions [B, n], caches) -> (logits
      [B, n, vocab], caches): a prompt (prefill) or new tokens appended to the caches
      (jit-able: generate() compiles the whole loop); None with `stream_decoder`.
    stream_decoder: None, or (module, params, batch, capacity) -> an object whose
      `feed(tokens int [B, n], keep=1)` appends tokens and returns the logits float32
      [B, keep, vocab] at the last `keep` of them: for models whose decoding state lives
      partly off the device (DRT's chunk memory in host RAM), driven from Python.
    last_logits: (module, params, tokens int [B, L], count) -> float32 [B, count, vocab]:
      the teacher-forced logits of the last `count` positions (what passkey and other
      long-prompt evaluations score). The default runs the whole forward pass; a family
      whose memory can stream (DRT: chunk memory in host RAM) overrides it so that L can
      exceed what the device holds.
    param_count: ModelConfig -> parameter count (closed form).
    training_flops_per_token: (ModelConfig, seq_len) -> forward + backward FLOPs per
      token, for MFU.
    frozen_source: None, or ModelConfig -> `FrozenSource`: parameters the loss needs but
      training never changes (a LongSpec draft's target), from another run's workdir
      (`castle_jax.workdir.load_frozen_params` restores them). The trainer passes them to
      `token_losses` merged into the parameter tree (`{**params, name: frozen}`); they get
      no gradient and no optimizer state, and are not saved with the run's checkpoints.
    training_only_kwargs: model.family_kwargs that change how the model trains, not its
      parameters: `train.init_from` accepts a source run that differs in them.
  """

  name: str
  build: Callable[[ModelConfig], nn.Module]
  init_variables: Callable[[nn.Module, jax.Array, int], Any]
  token_losses: Callable[..., tuple[jax.Array, jax.Array]]
  init_cache: Callable[[nn.Module, int, int], Any] | None
  decode: Callable[..., tuple[jax.Array, Any]] | None
  last_logits: Callable[..., jax.Array]
  param_count: Callable[[ModelConfig], int]
  training_flops_per_token: Callable[[ModelConfig, int], float]
  stream_decoder: Callable[..., Any] | None = None
  frozen_source: Callable[[ModelConfig], FrozenSource] | None = None
  training_only_kwargs: tuple[str, ...] = ()


MODEL_FAMILIES: dict[str, ModelFamily] = {
  "transformer": ModelFamily(
    name="transformer",
    build=transformer.TransformerLM,
    init_variables=_init_variables,
    token_losses=transformer.token_losses,
    init_cache=_init_cache,
    decode=_decode,
    last_logits=_last_logits,
    param_count=transformer.count_parameters,
    training_flops_per_token=transformer.training_flops_per_token,
  ),
  "drt": ModelFamily(
    name="drt",
    build=drt.build,
    init_variables=_init_variables,
    token_losses=drt.token_losses,
    init_cache=None,
    decode=None,
    last_logits=drt_decoding.last_logits,
    param_count=drt.param_count,
    training_flops_per_token=drt.training_flops_per_token,
    stream_decoder=drt_decoding.stream_decoder,
    training_only_kwargs=drt.TRAINING_ONLY_KWARGS,
  ),
  longspec_draft.FAMILY: ModelFamily(
    name=longspec_draft.FAMILY,
    build=longspec_draft.build,
    init_variables=longspec_draft.init_variables,
    token_losses=longspec_draft.token_losses,
    init_cache=None,
    decode=None,
    last_logits=longspec_draft.last_logits,
    param_count=longspec_draft.param_count,
    training_flops_per_token=longspec_draft.training_flops_per_token,
    frozen_source=longspec_draft.frozen_source,
    training_only_kwargs=longspec_draft.TRAINING_ONLY_KWARGS,
  ),
}


def get_family(name: str) -> ModelFamily:
  """Looks up a model family, with an error listing the known names."""
  if name not in MODEL_FAMILIES:
    raise ValueError(f"Unknown model family {name!r} (config model.family); known: {sorted(MODEL_FAMILIES)}")
  return MODEL_FAMILIES[name]


def family_of(module_or_config) -> ModelFamily:
  """The family of a ModelConfig or of a module built from one (it has `.config`)."""
  config = module_or_config if isinstance(module_or_config, ModelConfig) else module_or_config.config
  return get_family(config.family)


def build_model(config: ModelConfig) -> nn.Module:
  """The Flax module of config's family."""
  return get_family(config.family).build(config)


def count_parameters(config: ModelConfig) -> int:
  """Closed-form parameter count of config's model."""
  return get_family(config.family).param_count(config)


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Forward + backward FLOPs per trained token of config's model, for MFU."""
  return get_family(config.family).training_flops_per_token(config, seq_len)


def abstract_params(
  model: nn.Module, seq_len: int, device: jax.Device | None = None, mesh: jax.sharding.Mesh | None = None
) -> Any:
  """The model's parameters as ShapeDtypeStructs, from `jax.eval_shape` of its family's
  init (nothing is computed): sharded over `mesh` by their logical axis names, or else
  placed on one device (default: the first)."""
  with jax.set_mesh(None):
    boxed = jax.eval_shape(
      lambda rng: family_of(model).init_variables(model, rng, seq_len)["params"], jax.random.key(0)
    )
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
  if mesh is None:
    single = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    shardings = jax.tree.map(lambda _: single, boxed, is_leaf=is_box)
  else:
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, LOGICAL_AXIS_RULES)

  def place(leaf, sharding):
    value = leaf.unbox(apply_constraint=False) if is_box(leaf) else leaf
    return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

  return jax.tree.map(place, boxed, shardings, is_leaf=is_box)
