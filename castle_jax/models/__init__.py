"""Models built from the layers in `castle_jax.layers`, and the model-family table
(`registry`) through which the trainer and generate() reach them."""

from castle_jax.config import ModelConfig
from castle_jax.models.registry import (
  MODEL_FAMILIES,
  ModelFamily,
  build_model,
  count_parameters,
  family_of,
  get_family,
  training_flops_per_token,
)
from castle_jax.models.transformer import DecoderBlock, TransformerLM

__all__ = [
  "MODEL_FAMILIES",
  "DecoderBlock",
  "ModelConfig",
  "ModelFamily",
  "TransformerLM",
  "build_model",
  "count_parameters",
  "family_of",
  "get_family",
  "training_flops_per_token",
]
