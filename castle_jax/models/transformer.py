"""A LLaMA-style decoder LM with pluggable attention.

Block (pre-norm, residual around each sublayer):
    h = x + Attention(RMSNorm(x))
    y = h + SwiGLU(RMSNorm(h))
The CASTLE paper's Appendix A.1.1 prints Y = Attn(RMSNorm(X)), X' = SwiGLU(RMSNorm(Y))
without the residual additions; it states that it follows LLaMA, whose block is
the residual form above, so the residual form is used here.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from castle_jax.config import ModelConfig
from castle_jax.layers.embedding import lm_head, token_embedding
from castle_jax.layers.mlp import SwiGLU
from castle_jax.layers.norms import RMSNorm
from castle_jax.layers.registry import get_attention
from castle_jax.sharding import constrain


class DecoderBlock(nn.Module):
  """One pre-norm block: attention then SwiGLU, each with a residual connection."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, cache: Any = None, tree: Any = None):
    """x: [batch, seq, d_model] -> ([batch, seq, d_model], cache); tree: see TransformerLM."""
    cfg = self.config
    norm = lambda name: RMSNorm(cfg.norm_eps, cfg.compute_dtype, cfg.weights_dtype, name=name)
    attention = get_attention(cfg.attention).module(config=cfg, name="attention")
    tree_kwargs = {} if tree is None else {"tree": tree}  # only `mha` verifies trees
    h, cache = attention(norm("attention_norm")(x), positions, cache, **tree_kwargs)
    x = constrain(x + h, ("batch", "act_length", "act_embed"))
    mlp = SwiGLU(cfg.ffn_hidden, cfg.init_std, cfg.out_init_std, cfg.compute_dtype, cfg.weights_dtype, name="mlp")
    x = x + mlp(norm("mlp_norm")(x))
    return constrain(x, ("batch", "act_length", "act_embed")), cache


def rematerialized(block_cls, config: ModelConfig):
  """block_cls under `nn.remat` with the config's policy when model.remat is set, else block_cls.

  The blocks are not scanned, so the recomputed forward is fenced off (prevent_cse=True):
  without the fence XLA merges it with the original forward as common subexpressions on one
  GPU (remat then saves no memory), while under a device mesh the shard_map around the
  kernels keeps it, so the same model ran 25% more attention work on N devices than on one.
  """
  if not config.remat:
    return block_cls
  return nn.remat(block_cls, prevent_cse=True, policy=config.checkpoint_policy)


class TransformerLM(nn.Module):
  """Decoder-only language model.

  Call with tokens int [batch, seq] (and optionally positions int [batch, seq] and
  per-layer caches from `init_cache`) to get float32 logits [batch, seq, vocab_size]
  and the updated caches (None when no caches were given).

  With caches and `tree` (a `castle_jax.layers.mha.TreeVerification`, `mha` models only),
  the tokens are drafted tree nodes verified in one pass: each attends to the whole
  cache and to the nodes `tree.mask` allows; the caches are not changed and the second
  result is each layer's `PendingKV` of the nodes (speculative decoding commits the
  accepted ones).
  """

  config: ModelConfig

  @nn.compact
  def __call__(
    self, tokens: jax.Array, positions: jax.Array | None = None, caches: Sequence[Any] | None = None, tree: Any = None
  ):
    cfg = self.config
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be int [batch, seq], got shape {tokens.shape}")
    if tree is not None and caches is None:
      raise ValueError("tree verification needs the caches of the committed tokens (pass caches)")
    if positions is None:
      if caches is not None:
        raise ValueError("positions are required when decoding with caches")
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    embed = token_embedding(cfg, "embed")
    x = constrain(embed(tokens), ("batch", "act_length", "act_embed"))

    block_cls = rematerialized(DecoderBlock, cfg) if caches is None else DecoderBlock
    new_caches = []
    for layer in range(cfg.n_layers):
      x, cache = block_cls(cfg, name=f"block_{layer}")(x, positions, None if caches is None else caches[layer], tree)
      new_caches.append(cache)

    x = RMSNorm(cfg.norm_eps, cfg.compute_dtype, cfg.weights_dtype, name="final_norm")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = lm_head(cfg, "lm_head")(x)
    logits = constrain(logits.astype(jnp.float32), ("batch", "act_length", "act_vocab"))
    return logits, (None if caches is None else new_caches)

  def init_cache(self, batch: int, capacity: int) -> list[Any]:
    """Empty per-layer decoding caches that hold up to `capacity` tokens."""
    kind = get_attention(self.config.attention)
    return [kind.init_cache(self.config, batch, capacity) for _ in range(self.config.n_layers)]


def count_parameters(config: ModelConfig) -> int:
  """Closed-form parameter count (what `init` creates), from the shapes alone."""
  d = config.d_model
  attention = get_attention(config.attention).param_count(config)
  block = attention + 3 * d * config.ffn_hidden + 2 * d  # + two RMSNorm scales
  embeddings = config.vocab_size * d * (1 if config.tie_embeddings else 2)
  return embeddings + config.n_layers * block + d  # + final norm


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Model FLOPs per trained token (forward + backward), for MFU.

  6 per parameter that multiplies an activation (every matrix, the LM head
  included; embedding lookups and norm scales are not matmuls), plus each layer's
  attention core, counted with causal masking (a query sees (T+1)/2 keys on average).
  """
  d = config.d_model
  matmul_params = count_parameters(config) - (2 * config.n_layers + 1) * d  # minus norm scales
  if not config.tie_embeddings:
    matmul_params -= config.vocab_size * d  # the input table is only a lookup; lm_head is the matmul
  core = get_attention(config.attention).core_flops_per_token(config, seq_len)
  return 6 * matmul_params + config.n_layers * core


def token_losses(
  model: TransformerLM, params: Any, batch: dict[str, jax.Array], pad_id: int, rng: jax.Array | None = None
):
  """Per-token negative log-likelihood of next-token prediction.

  Args:
    batch: {"inputs": int [B, T], "targets": int [B, T]}.
    rng: unused (the transformer draws no noise in training).

  Returns:
    (nll float32 [B, T], weights float32 [B, T]) with weight 0 at PAD targets.
  """
  del rng
  logits, _ = model.apply({"params": params}, batch["inputs"])
  return next_token_losses(logits, batch["targets"], pad_id)


def next_token_losses(logits: jax.Array, targets: jax.Array, pad_id: int):
  """(nll float32 [B, T] weighted, weights float32 [B, T]) of logits [B, T, V] for targets
  int [B, T], with weight 0 at PAD targets."""
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  weights = (targets != pad_id).astype(jnp.float32)
  return (log_z - target_logits) * weights, weights
