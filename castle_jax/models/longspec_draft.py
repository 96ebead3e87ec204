"""LongSpec's draft model (Yang et al., "LongSpec: Long-Context Lossless Speculative Decoding
with Efficient Drafting and Verification", Sec. 3.1-3.2; engineering choices from the
authors' code where the paper is silent).

One block with the widths of a frozen `mha` target, which it drafts for:

    h  = E(x)                                the target's token embedding (shared, frozen)
    h += SWA(RMSNorm(h))                     causal sliding-window self-attention over W
                                             positions (512), the target's RoPE and positions
    h += CrossAttn(RMSNorm(h); K_T, V_T)     queries RoPE'd at the draft token's position;
                                             keys/values: the target's LAST-layer KV cache as
                                             stored (already rotated), grouped heads as the
                                             target's; no key/value projections of its own
    h += SwiGLU(RMSNorm(h))
    logits = the target's head on h: its final RMSNorm and LM head (shared, frozen)

The authors' code applies the LM head without a final norm; here the target's own final
norm comes with its head, so the draft's output enters the head as the target's last
hidden state does. The draft's own decoding state is a ring of the last W positions'
self-attention keys/values: constant in the context length. Its self-attention keys depend
only on the token and its position (the block's first sublayer reads E(x)), so a
committed token's entry is exact whatever the draft saw when it drafted it.

Training (`token_losses`), the target frozen and run on the same tokens and positions:
  - anchor-offset indices (Sec. 3.2): positions [0 .. a-1] then [a + o, a + o + 1, ...]
    with o ~ U{0 .. max_offset} per sequence, so large position indices are trained from
    short samples while the target, which attends to its first tokens as sinks, stays in
    distribution; max_offset = 0 gives the plain positions (long-data stage);
  - flash noisy training: the cross-attention query at i sees the target's keys/values
    only at positions <= i - j, j ~ U{min_shift .. max_shift} per step, computed as a
    plain causal attention of Q[j:] over K[:T-j], V[:T-j] (no mask materialized; run at
    the full length with the shifted queries padded at the end);
    positions < j get no cross-attention output. In speculative decoding the draft's
    forward at tree depth d (root 0) sees the target's cache up to i - (d + 1), so a tree
    of depth D needs shifts 1 .. D; evaluation uses min_shift.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from castle_jax.config import ModelConfig
from castle_jax.layers.embedding import lm_head, token_embedding
from castle_jax.layers.mlp import SwiGLU
from castle_jax.layers.norms import RMSNorm
from castle_jax.layers.rope import apply_rope
from castle_jax.layers.shared import mean_visible_keys, output_projection, projection, rotary_qkv
from castle_jax.models.family_options import parse_family_options
from castle_jax.models.frozen import FrozenSource
from castle_jax.models.transformer import TransformerLM, next_token_losses
from castle_jax.models.transformer import count_parameters as count_transformer_parameters
from castle_jax.ops.attention import WindowKVCache, causal_attention, causal_mask, masked_attention
from castle_jax.ops.tree_attention import cache_attention

FAMILY = "longspec_draft"
# The key under which the trainer passes the frozen target's parameters next to the draft's.
TARGET = "target"


@dataclasses.dataclass(frozen=True)
class DraftOptions:
  """model.family_kwargs of a LongSpec draft (the rest of model.* are the target's widths).

  Attributes:
    target_workdir: the target's training workdir (config.json and checkpoints); the
      target is restored from its newest good checkpoint, or from `target_step`. Or a
      Hugging Face model directory (`castle_jax.models.hf`; no `target_step`): the
      trainer then takes model.* and data.tokenizer from it
      (`castle_jax.workdir.with_hf_frozen_source`).
    target_step: a checkpoint step of the target (None: the newest good one).
    window: W, the self-attention window (the paper: 512).
    anchor_tokens: a, positions kept at 0 .. a-1 by anchor-offset indexing (the paper: 4).
    max_offset: largest random offset o of anchor-offset indexing (0: plain positions;
      the paper: 15K-30K on short data, 0 on long data).
    min_shift, max_shift: range of the noisy-training shift j (min_shift = max_shift: no
      noise; every j >= 1, since a drafted token is never in the target's cache yet).
  """

  target_workdir: str = ""
  target_step: int | None = None
  window: int = 512
  anchor_tokens: int = 4
  max_offset: int = 0
  min_shift: int = 1
  max_shift: int = 5

  def __post_init__(self):
    if not isinstance(self.target_workdir, str):
      raise ValueError(f"model.family_kwargs.target_workdir must be a path, got {self.target_workdir!r}")
    for name, low in (("window", 1), ("anchor_tokens", 0), ("max_offset", 0), ("min_shift", 1)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"model.family_kwargs.{name} must be an int >= {low}, got {value!r}")
    if isinstance(self.max_shift, bool) or not isinstance(self.max_shift, int) or self.max_shift < self.min_shift:
      raise ValueError(
        f"model.family_kwargs.max_shift must be an int >= min_shift ({self.min_shift}), got {self.max_shift!r}"
      )
    if self.target_step is not None and (not isinstance(self.target_step, int) or self.target_step < 0):
      raise ValueError(f"model.family_kwargs.target_step must be None or a step >= 0, got {self.target_step!r}")

  @classmethod
  def from_config(cls, config: ModelConfig) -> "DraftOptions":
    options = parse_family_options(cls, config, FAMILY)
    check_target_config(target_config(config))
    return options


# family_kwargs that change how the draft trains, not its parameters: a later stage may
# start from an earlier one's draft (train.init_from) with other values.
TRAINING_ONLY_KWARGS = ("anchor_tokens", "max_offset", "min_shift", "max_shift")


def target_config(config: ModelConfig) -> ModelConfig:
  """The target's ModelConfig from the draft's (which carries the target's widths)."""
  return dataclasses.replace(config, family="transformer", family_kwargs=(), remat=False)


def check_target_config(config: ModelConfig) -> None:
  """A LongSpec target must be a full-causal RoPE `mha` transformer."""
  if config.attention != "mha" or config.options.positions != "rope" or config.sliding_window:
    raise ValueError(
      "a LongSpec draft needs an `mha` target with RoPE and full causal attention (model.attention='mha', "
      f"no sliding window, positions='rope'); got attention={config.attention!r}, sliding_window="
      f"{config.sliding_window}. CASTLE or power-attention targets would need the draft to cross-attend "
      "over their decoding state instead of a KV cache (see docs/longspec.md, \"Other targets\")."
    )


@flax.struct.dataclass
class DraftSelfCache:
  """The draft's self-attention keys/values while it drafts one tree.

  Attributes:
    ring: the committed tokens' entries, the last positions in a ring (constant size).
    keys, values: [batch, nodes, kv_heads, head_dim], the entries of this round's root
      (slot 0) and drafted nodes, by node index.
  """

  ring: WindowKVCache
  keys: jax.Array
  values: jax.Array

  @classmethod
  def create(cls, config: ModelConfig, batch: int, window: int, nodes: int, max_commit: int) -> "DraftSelfCache":
    """A ring that keeps every position a window-W query can see while up to
    `max_commit` positions are committed at once, and `nodes` tree slots."""
    ring = WindowKVCache.create(batch, window + max_commit, config.kv_heads, config.qk_head_dim, config.compute_dtype)
    shape = (batch, nodes, config.kv_heads, config.qk_head_dim)
    return cls(ring, jnp.zeros(shape, config.compute_dtype), jnp.zeros(shape, config.compute_dtype))


class DraftSelfAttention(nn.Module):
  """Sliding-window causal self-attention with the target's RoPE (and, when the target's
  query/key/value projections have biases, model.qkv_bias, its own have them too: the
  draft block mirrors the target's layers)."""

  config: ModelConfig
  window: int

  @nn.compact
  def __call__(
    self, x, positions, cache: DraftSelfCache | None = None, slots=None, visible=None, keys_values_only: bool = False
  ):
    """x: [batch, n, d_model], positions: int [batch, n].

    Training (cache None): causal attention over the sequence within the window.
    Drafting: the n tokens' entries are written at tree `slots` (int [n]); each sees the
    ring within the window and the tree slots `visible` (bool [batch, n, nodes]).
    keys_values_only: return only this sublayer's (keys, values) [batch, n, kv_heads,
    head_dim] of x (to commit tokens to the ring).

    Returns ([batch, n, d_model], cache).
    """
    cfg = self.config
    q, k, v = rotary_qkv(cfg, x, positions)
    if keys_values_only:
      return k, v
    if cache is None:
      out = causal_attention(q, k, v, window=self.window, implementation=cfg.attention_impl)
      return output_projection(cfg, out), None
    cache = cache.replace(
      keys=cache.keys.at[:, slots].set(k.astype(cache.keys.dtype)),
      values=cache.values.at[:, slots].set(v.astype(cache.values.dtype)),
    )
    ring_visible = causal_mask(positions, cache.ring.key_positions(), self.window)
    out = masked_attention(
      q,
      jnp.concatenate([cache.ring.keys, cache.keys], axis=1),
      jnp.concatenate([cache.ring.values, cache.values], axis=1),
      jnp.concatenate([ring_visible, visible], axis=-1),
    )
    return output_projection(cfg, out), cache


def _shifted_causal_attention(q, k, v, shift: int, implementation):
  """Query i attends to keys 0 .. i - shift (zeros for i < shift).

  Causal attention of q[shift:] over k[:T - shift], computed at the full length T (cuDNN
  takes only some lengths): the shifted queries padded at the end attend causally to all
  of k, and the padding rows' outputs are dropped."""
  length = q.shape[1]
  if shift >= length:
    return jnp.zeros_like(q)
  shifted = jnp.pad(q[:, shift:], ((0, 0), (0, shift), (0, 0), (0, 0)))
  out = causal_attention(shifted, k, v, implementation=implementation)
  return jnp.pad(out[:, : length - shift], ((0, 0), (shift, 0), (0, 0), (0, 0)))


class DraftCrossAttention(nn.Module):
  """Cross-attention over the target's last-layer keys/values (no key/value projections)."""

  config: ModelConfig
  min_shift: int
  max_shift: int

  @nn.compact
  def __call__(self, x, positions, keys, values, *, shift=None, length=None):
    """x: [batch, n, d_model]; keys, values: [batch, S, kv_heads, head_dim], rotated.

    Training (length None): S == n, aligned with x; query i sees keys <= i - shift
    (shift: int32 scalar in [min_shift, max_shift], may be traced).
    Decoding: `length` (int32 scalar) filled cache slots, all visible to every query.
    """
    cfg = self.config
    q = projection((cfg.n_heads, cfg.qk_head_dim), ("embed", "heads", "head_dim"), cfg.init_std, cfg, "query")(x)
    q = apply_rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
    if length is not None:
      out, _ = cache_attention(q, keys.astype(q.dtype), values.astype(q.dtype), length)
    else:
      branches = [
        functools.partial(_shifted_causal_attention, shift=j, implementation=cfg.attention_impl)
        for j in range(self.min_shift, self.max_shift + 1)
      ]
      index = jnp.clip(jnp.asarray(shift, jnp.int32) - self.min_shift, 0, len(branches) - 1)
      out = jax.lax.switch(index, branches, q, keys.astype(q.dtype), values.astype(q.dtype))
    return output_projection(cfg, out)


class LongSpecDraft(nn.Module):
  """The draft block. Its parameters are the block's only; the embedding, final norm and
  LM head are the target's (`embed_tokens`, `draft_logits`)."""

  config: ModelConfig
  options: DraftOptions

  def setup(self):
    cfg, opts = self.config, self.options
    make_norm = lambda: RMSNorm(cfg.norm_eps, cfg.compute_dtype, cfg.weights_dtype)
    self.self_norm, self.cross_norm, self.mlp_norm = make_norm(), make_norm(), make_norm()
    self.self_attention = DraftSelfAttention(cfg, opts.window)
    self.cross_attention = DraftCrossAttention(cfg, opts.min_shift, opts.max_shift)
    self.mlp = SwiGLU(cfg.ffn_hidden, cfg.init_std, cfg.init_std / 2**0.5, cfg.compute_dtype, cfg.weights_dtype)

  def __call__(self, h, positions, target_keys, target_values, shift):
    """Training. h: [B, T, d_model] (the target's embedding of the tokens), positions int
    [B, T], target_keys/values [B, T, kv_heads, head_dim] (its last layer at the same
    positions), shift: int32 scalar -> [B, T, d_model]."""
    h = h + self.self_attention(self.self_norm(h), positions)[0]
    h = h + self.cross_attention(self.cross_norm(h), positions, target_keys, target_values, shift=shift)
    return h + self.mlp(self.mlp_norm(h))

  def draft(self, h, positions, cache: DraftSelfCache, slots, visible, target_keys, target_values, target_length):
    """One drafting forward over n tokens (a tree level). h: [B, n, d_model]; slots int [n];
    visible bool [B, n, nodes]; target_keys/values: the target's last-layer cache [B, C,
    kv_heads, head_dim] with `target_length` filled slots -> ([B, n, d_model], cache)."""
    attended, cache = self.self_attention(self.self_norm(h), positions, cache, slots, visible)
    h = h + attended
    h = h + self.cross_attention(self.cross_norm(h), positions, target_keys, target_values, length=target_length)
    return h + self.mlp(self.mlp_norm(h)), cache

  def self_keys_values(self, h, positions):
    """The self-attention (keys, values) [B, n, kv_heads, head_dim] of tokens h [B, n, d_model]."""
    return self.self_attention(self.self_norm(h), positions, keys_values_only=True)


# The target's pieces the draft shares (read from the target's parameter tree).


def embed_tokens(config: ModelConfig, target_params: Any, tokens: jax.Array) -> jax.Array:
  """The target's embedding of tokens int [B, n] -> [B, n, d_model]."""
  return token_embedding(config).apply({"params": target_params["embed"]}, tokens)


def draft_logits(config: ModelConfig, target_params: Any, h: jax.Array) -> jax.Array:
  """The target's head (final RMSNorm, LM head) on the draft's output [B, n, d_model] ->
  float32 [B, n, vocab]."""
  x = RMSNorm(config.norm_eps, config.compute_dtype, config.weights_dtype).apply(
    {"params": target_params["final_norm"]}, h
  )
  if config.tie_embeddings:
    logits = token_embedding(config).apply({"params": target_params["embed"]}, x, method="attend")
  else:
    logits = lm_head(config).apply({"params": target_params["lm_head"]}, x)
  return logits.astype(jnp.float32)


def target_last_layer_keys_values(
  config: ModelConfig, target_params: Any, tokens: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """The frozen target's last-layer (keys, values) [B, T, kv_heads, head_dim] (rotated) of a
  teacher-forced forward pass; the layers after that attention are never computed (XLA
  drops them)."""
  _, state = TransformerLM(config).apply({"params": target_params}, tokens, positions, mutable=["intermediates"])
  keys, values = state["intermediates"][f"block_{config.n_layers - 1}"]["attention"]["keys_values"][0]
  return jax.lax.stop_gradient(keys), jax.lax.stop_gradient(values)


def anchor_offset_positions(rng: jax.Array, shape: tuple[int, int], anchor_tokens: int, max_offset: int) -> jax.Array:
  """int32 [B, T]: [0 .. a-1, a + o, a + o + 1, ...] with o ~ U{0 .. max_offset} per row."""
  batch, length = shape
  plain = jnp.arange(length, dtype=jnp.int32)
  offsets = jax.random.randint(rng, (batch, 1), 0, max_offset + 1, dtype=jnp.int32)
  return jnp.where(plain < anchor_tokens, plain, plain + offsets)


def split_params(params: Any) -> tuple[Any, Any]:
  """(draft parameters, target parameters) of the tree the trainer passes."""
  if TARGET not in params:
    raise ValueError(f"a LongSpec draft's loss needs the frozen target's parameters under params[{TARGET!r}]")
  return {k: v for k, v in params.items() if k != TARGET}, params[TARGET]


# The model-family entry (castle_jax.models.registry).


def build(config: ModelConfig) -> LongSpecDraft:
  return LongSpecDraft(config, DraftOptions.from_config(config))


def init_variables(model: LongSpecDraft, rng: jax.Array, seq_len: int):
  cfg = model.config
  h = jnp.zeros((1, seq_len, cfg.d_model), cfg.compute_dtype)
  kv = jnp.zeros((1, seq_len, cfg.kv_heads, cfg.qk_head_dim), cfg.compute_dtype)
  positions = jnp.arange(seq_len, dtype=jnp.int32)[None]
  return model.init(rng, h, positions, kv, kv, jnp.int32(model.options.min_shift))


def token_losses(
  model: LongSpecDraft, params: Any, batch: dict[str, jax.Array], pad_id: int, rng: jax.Array | None = None
):
  """Next-token losses of the draft on batch {"inputs", "targets": int [B, T]}; params holds
  the draft's parameters and the frozen target's under "target". In training (rng given)
  the positions are anchor-offset and the cross-attention shift is random; in evaluation
  the positions are plain and the shift is min_shift."""
  draft_params, target_params = split_params(params)
  target_params = jax.lax.stop_gradient(target_params)
  cfg, opts = model.config, model.options
  tokens = batch["inputs"]
  if rng is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    shift = jnp.int32(opts.min_shift)
  else:
    position_rng, shift_rng = jax.random.split(rng)
    positions = anchor_offset_positions(position_rng, tokens.shape, opts.anchor_tokens, opts.max_offset)
    shift = jax.random.randint(shift_rng, (), opts.min_shift, opts.max_shift + 1, dtype=jnp.int32)
  target = target_config(cfg)
  keys, values = target_last_layer_keys_values(target, target_params, tokens, positions)
  h = model.apply({"params": draft_params}, embed_tokens(target, target_params, tokens), positions, keys, values, shift)
  return next_token_losses(draft_logits(target, target_params, h), batch["targets"], pad_id)


def last_logits(model, params, tokens, count):
  raise ValueError(
    "a LongSpec draft is not a language model on its own: it drafts for its target inside "
    "speculative decoding (castle_jax.inference.speculative_generate)"
  )


def param_count(config: ModelConfig) -> int:
  """The draft block's parameters (the embedding, final norm and head are the target's)."""
  d, heads, kv_heads, head_dim = config.d_model, config.n_heads, config.kv_heads, config.qk_head_dim
  self_attention = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim
  if config.qkv_bias:  # the target's query/key/value biases, in the draft's own self-attention
    self_attention += (heads + 2 * kv_heads) * head_dim
  cross_attention = 2 * d * heads * head_dim
  return self_attention + cross_attention + 3 * d * config.ffn_hidden + 3 * d


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """The draft's forward + backward and the frozen target's forward (up to its last
  attention; its LM head is skipped) per token, plus the head on the draft's output."""
  options = DraftOptions.from_config(config)
  target = target_config(config)
  target_matmuls = count_transformer_parameters(target) - (2 * target.n_layers + 1) * config.d_model
  # The target's embedding is a lookup and its LM head never runs.
  target_matmuls -= config.vocab_size * config.d_model * (1 if config.tie_embeddings else 2)
  head = config.vocab_size * config.d_model
  core = 4 * config.n_heads * config.qk_head_dim
  draft_attention = core * (mean_visible_keys(seq_len, options.window) + (seq_len + 1) / 2)
  target_attention = target.n_layers * core * (seq_len + 1) / 2
  draft_matmuls = param_count(config) - 3 * config.d_model
  return 3 * (2 * draft_matmuls + 2 * head + draft_attention) + 2 * target_matmuls + target_attention


# Fields of ModelConfig that are numerics or speed choices, free to differ between a
# target's run and its draft's; every other field fixes the target's parameters.
_FREE_FIELDS = ("family", "family_kwargs", "attention_impl", "dtype", "param_dtype", "remat", "init_std")


def width_differences(target: ModelConfig, draft: ModelConfig) -> list[str]:
  """`model.key: target X, draft Y` for every field where the draft's config does not
  describe the target (the draft takes the target's widths)."""
  differing = []
  for field in dataclasses.fields(ModelConfig):
    if field.name in _FREE_FIELDS:
      continue
    theirs, ours = getattr(target, field.name), getattr(draft, field.name)
    if theirs != ours:
      differing.append(f"model.{field.name}: target {theirs!r}, draft {ours!r}")
  return differing


def frozen_source(config: ModelConfig) -> FrozenSource:
  """Where the draft's frozen target comes from (model.family_kwargs.target_workdir: a
  training workdir or a Hugging Face model directory); the target's model must have the
  draft's widths (`width_differences`)."""
  options = DraftOptions.from_config(config)
  if not options.target_workdir:
    raise ValueError(
      "model.family_kwargs.target_workdir is empty: set it to the target's training workdir or Hugging Face "
      "model directory (e.g. --config.model.family_kwargs.target_workdir=runs/longspec_target_tiny)"
    )
  target = target_config(config)

  def differences(saved: ModelConfig) -> list[str]:
    if saved.family != "transformer":
      return [f"model.family: target {saved.family!r}, a LongSpec target is a 'transformer'"]
    return width_differences(saved, config)

  return FrozenSource(
    TARGET,
    os.path.abspath(options.target_workdir),
    options.target_step,
    "model.family_kwargs.target_workdir",
    target,
    differences,
    adopt=functools.partial(with_target_widths, config),
    step_setting="model.family_kwargs.target_step",
  )


def with_target_widths(config: ModelConfig, target: ModelConfig) -> ModelConfig:
  """The draft's `config` describing `target`: every field `width_differences` compares
  taken from it (the draft's numerics and family options stay)."""
  fixed = {field.name: getattr(target, field.name) for field in dataclasses.fields(ModelConfig)}
  return dataclasses.replace(config, **{name: value for name, value in fixed.items() if name not in _FREE_FIELDS})
