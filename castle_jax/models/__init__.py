"""Language models built from the layers in `castle_jax.layers`."""

from castle_jax.models.config import ModelConfig
from castle_jax.models.transformer import DecoderBlock, TransformerLM, count_parameters, training_flops_per_token

__all__ = ["DecoderBlock", "ModelConfig", "TransformerLM", "count_parameters", "training_flops_per_token"]
