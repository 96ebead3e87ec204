"""DRT: the Differentiable Retrieval Transformer (Hu et al., "Efficient Length-Generalizable
Attention via Causal Retrieval", Sec. 3.1; engineering choices from the authors' code).

Layout. The tokens are cut into chunks of S real tokens and a learned landmark (LMK) is
appended to each chunk, so the decoder runs over chunks * (S + 1) positions. The model
takes and returns real tokens only: logits [batch, seq, vocab] line up with the input
tokens, the landmark positions are dropped before the LM head, so they carry no loss and
a trainer needs no special case. seq need not be a multiple of S (the last chunk is
padded after the real tokens; by causality the padding changes nothing before it).

    x = embed(tokens) with an LMK after every S tokens
    N/2 lower blocks:  h = x + SWA(RMSNorm(x)); x = h + MLP(RMSNorm(h))
    chunk encoder:     C_c = RMSNorm(bidirectional blocks with RoPE at 0..S over
                       RMSNorm(x) of chunk c); landmark l_c = C_c[LMK]
    memory:            K_c = C_c[:S] W_K, V_c = C_c[:S] W_V, one pair shared by every
                       upper layer (Eq. 3)
    per group g of upper blocks:
      retrieval:       r[t, c] = <RMSNorm_g(x_t[LMK]), l_c> / sqrt(d_model) for c < t
                       (the authors' code; the paper's W_h, W_l projections are not used),
                       top-k with Gumbel noise in training, weights = softmax of the
                       selected noise-free scores; chunk t's retrieval serves chunk t+1,
                       chunk 0 retrieves nothing (family_kwargs retriever="random": k
                       chunks drawn uniformly among c < t instead, see `select`)
      upper block:     h = x + SWA(RMSNorm(x)); a = GCA(RMSNorm(h)) over the retrieved
                       memory; x = h + MLP(RMSNorm(h + a))
                       (the authors' code: the GCA output enters the residual stream
                       only through the MLP input; the paper's Eq. 2 reads Norm(H + O);
                       family_kwargs gca_output="residual" adds a to the stream too)
    logits = LM head(RMSNorm(x)) at the real positions

SWA: `mha` with ALiBi biases over model.sliding_window, no RoPE; GCA:
softmax_1 per retrieved chunk (`ops.gca`), whose implicit zero logit is the authors'
zeroed landmark row of K and V.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.layers.embedding import lm_head, token_embedding
from castle_jax.layers.mha import MultiHeadAttention
from castle_jax.layers.shared import mean_visible_keys, output_projection, projection, rotary_qkv
from castle_jax.layers.mlp import SwiGLU
from castle_jax.layers.norms import RMSNorm
from castle_jax.config import ModelConfig
from castle_jax.models.family_options import parse_family_options
from castle_jax.models.transformer import next_token_losses, rematerialized
from castle_jax.ops.gca import gca_attention, retrieval_scores, select_chunks
from castle_jax.sharding import constrain, with_axes

RETRIEVERS = ("learned", "random")
GCA_OUTPUTS = ("mlp_input", "residual")
# Options that change which chunks are read, not the parameters: a run may
# `train.init_from` a run with other values (e.g. all chunks, then a sharper top-k; or a
# run that read every chunk, then the random-retriever control).
TRAINING_ONLY_KWARGS = ("top_k", "gumbel", "retriever")
# The random retriever outside training (evaluation, decoding) draws its chunks from this
# fixed key, folded with the group and the chunk positions (`position_priorities`).
RANDOM_RETRIEVER_EVAL_SEED = 0


@dataclasses.dataclass(frozen=True)
class DRTOptions:
  """What DRT adds to the decoder's shapes (`ModelConfig`).

  Attributes:
    chunk_size: S, real tokens per chunk (the landmark comes on top).
    top_k: chunks retrieved per group and chunk (k; min(k, chunks) are used).
    retrieval_groups: G, groups of upper layers, one retrieval each (1: "retrieval x1").
    encoder_layers: bidirectional layers of the chunk encoder.
    gumbel: add Gumbel noise before the learned top-k in training (False: the ablation;
      the random retriever draws its chunks either way).
    retriever: "learned", or "random": the paper's random-retriever ablation (Sec. 4.1.2,
      "We pick top-k chunks randomly but still keep GCA learnable"): each chunk's k chunks
      are drawn uniformly among the earlier ones, whatever their scores, and GCA still
      mixes them with the softmax of their learned relevance scores (see `select`).
    gca_output: where an upper block's GCA output a goes. "mlp_input" (the authors' code):
      x = h + MLP(RMSNorm(h + a)), a reaches the residual stream only through the MLP.
      "residual" (a reading of the paper's Eq. 2, H + O): x = h + a + MLP(RMSNorm(h + a)),
      a also enters the residual stream directly, as a self-attention output does.
  """

  chunk_size: int = 64
  top_k: int = 8
  retrieval_groups: int = 1
  encoder_layers: int = 2
  gumbel: bool = True
  retriever: str = "learned"
  gca_output: str = "mlp_input"

  def __post_init__(self):
    for name in ("chunk_size", "top_k", "retrieval_groups", "encoder_layers"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model.family_kwargs.{name} must be an int >= 1, got {value!r}")
    if not isinstance(self.gumbel, bool):
      raise ValueError(f"model.family_kwargs.gumbel must be True or False, got {self.gumbel!r}")
    if self.retriever not in RETRIEVERS:
      raise ValueError(f"model.family_kwargs.retriever must be one of {RETRIEVERS}, got {self.retriever!r}")
    if self.gca_output not in GCA_OUTPUTS:
      raise ValueError(f"model.family_kwargs.gca_output must be one of {GCA_OUTPUTS}, got {self.gca_output!r}")

  @classmethod
  def from_config(cls, config: ModelConfig) -> "DRTOptions":
    """model.family_kwargs parsed (unknown keys are errors) and checked against the config."""
    options = parse_family_options(cls, config, "drt")
    if config.sliding_window < 1:
      raise ValueError(
        "model family 'drt' needs model.sliding_window >= 1: the decoder's self-attention window (the paper uses 512)"
      )
    if config.attention != "mha" or config.options.positions != "alibi":
      raise ValueError(
        "model family 'drt' runs ALiBi sliding-window self-attention: set model.attention='mha' "
        "and model.attention_kwargs.positions='alibi'"
      )
    options.upper_layer_groups(config.n_layers)
    return options

  def upper_layer_groups(self, n_layers: int) -> list[int]:
    """Upper layers per retrieval group: the n_layers - n_layers // 2 upper layers split evenly."""
    upper = n_layers - n_layers // 2
    if n_layers < 2 or upper % self.retrieval_groups:
      raise ValueError(
        f"model.n_layers ({n_layers}) must give n_layers - n_layers // 2 upper layers divisible by "
        f"retrieval_groups ({self.retrieval_groups}), with at least one lower layer"
      )
    return [upper // self.retrieval_groups] * self.retrieval_groups


def norm(config: ModelConfig, name: str | None = None) -> RMSNorm:
  return RMSNorm(config.norm_eps, config.compute_dtype, config.weights_dtype, name=name)


class ChunkEncoderBlock(nn.Module):
  """Bidirectional pre-norm block over one chunk, RoPE at in-chunk positions 0..S."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [chunks, S + 1, d_model] -> same."""
    cfg = self.config
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    q, k, v = rotary_qkv(cfg, norm(cfg, "attention_norm")(x), positions)
    x = x + output_projection(cfg, jax.nn.dot_product_attention(q, k, v))
    mlp = SwiGLU(cfg.ffn_hidden, cfg.init_std, cfg.out_init_std, cfg.compute_dtype, cfg.weights_dtype, name="mlp")
    return x + mlp(norm(cfg, "mlp_norm")(x))


class ChunkMemory(nn.Module):
  """The chunk encoder and the shared memory projections (Eq. 3)."""

  config: ModelConfig
  options: DRTOptions

  @nn.compact
  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x: [batch, chunks, S + 1, d_model], the last lower layer's states of whole chunks
    (landmark last) -> (landmarks [batch, chunks, d_model], keys and values [batch, chunks,
    S, kv_heads, head_dim])."""
    cfg, size = self.config, self.options.chunk_size
    batch, chunks = x.shape[:2]
    encoded = norm(cfg, "input_norm")(x).reshape(batch * chunks, size + 1, cfg.d_model)
    for layer in range(self.options.encoder_layers):
      encoded = ChunkEncoderBlock(cfg, name=f"encoder_{layer}")(encoded)
    encoded = norm(cfg, "output_norm")(encoded).reshape(batch, chunks, size + 1, cfg.d_model)
    shape, axes = (cfg.kv_heads, cfg.qk_head_dim), ("embed", "kv_heads", "head_dim")
    keys = projection(shape, axes, cfg.init_std, cfg, "key")(encoded[:, :, :size])
    values = projection(shape, axes, cfg.init_std, cfg, "value")(encoded[:, :, :size])
    return encoded[:, :, size], keys, values


class GroupedCrossAttention(nn.Module):
  """The GCA sublayer: per-layer queries and output projection over the shared memory."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x, memory_k, memory_v, weights, indices, query_offset=None):
    """x: [batch, positions, d_model]; memory_k/v: [batch, chunks, S, kv_heads, head_dim];
    weights, indices: [batch, query_chunks, k] (row c is what query chunk c reads).

    query_offset: None when x is whole query chunks of S + 1 positions; in decoding, x
      may start `query_offset` positions into its first query chunk and end anywhere (the
      queries are placed on the [query_chunks * (S + 1)] grid the op expects; a query's
      output does not depend on the other rows).
    """
    cfg = self.config
    q = projection((cfg.n_heads, cfg.qk_head_dim), ("embed", "heads", "head_dim"), cfg.init_std, cfg, "query")(x)
    if query_offset is None:
      return output_projection(cfg, gca_attention(q, memory_k, memory_v, weights, indices))
    grid = jnp.zeros((q.shape[0], weights.shape[1] * (memory_k.shape[2] + 1), *q.shape[2:]), q.dtype)
    grid = jax.lax.dynamic_update_slice(grid, q, (0, query_offset, 0, 0))
    out = gca_attention(grid, memory_k, memory_v, weights, indices)
    return output_projection(cfg, jax.lax.dynamic_slice(out, (0, query_offset, 0, 0), q.shape))


class DRTBlock(nn.Module):
  """A decoder block; with `cross_attention` an upper block (GCA between attention and MLP,
  its output placed as `gca_output` says, see `DRTOptions`). Its self-attention is `mha`
  with ALiBi over model.sliding_window."""

  config: ModelConfig
  cross_attention: bool = False
  gca_output: str = "mlp_input"

  @nn.compact
  def __call__(self, x, memory=None, positions=None, cache=None, query_offset=None):
    """x: [batch, positions, d_model] -> ([batch, positions, d_model], cache).

    memory: (memory_k, memory_v, weights, indices) for an upper block, else None.
    positions: int [batch, positions] in the landmark layout (default 0, 1, ...).
    cache: the self-attention's `WindowKVCache` when decoding, else None (training).
    query_offset: see `GroupedCrossAttention` (decoding).
    """
    cfg = self.config
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    h, cache = MultiHeadAttention(cfg, name="attention")(norm(cfg, "attention_norm")(x), positions, cache)
    x = constrain(x + h, ("batch", "act_length", "act_embed"))
    mlp_input = x
    if self.cross_attention:
      cross = GroupedCrossAttention(cfg, name="cross_attention")
      mlp_input = x + cross(norm(cfg, "cross_attention_norm")(x), *memory, query_offset=query_offset)
      if self.gca_output == "residual":
        x = mlp_input
    mlp = SwiGLU(cfg.ffn_hidden, cfg.init_std, cfg.out_init_std, cfg.compute_dtype, cfg.weights_dtype, name="mlp")
    return constrain(x + mlp(norm(cfg, "mlp_norm")(mlp_input)), ("batch", "act_length", "act_embed")), cache


def insert_landmarks(x: jax.Array, landmark: jax.Array, chunk_size: int) -> jax.Array:
  """[batch, chunks * S, d] real-token states -> [batch, chunks * (S + 1), d] with `landmark` [d]
  after every chunk."""
  batch, length, dim = x.shape
  chunks = x.reshape(batch, length // chunk_size, chunk_size, dim)
  marks = jnp.broadcast_to(landmark.astype(x.dtype), (batch, chunks.shape[1], 1, dim))
  return jnp.concatenate([chunks, marks], axis=2).reshape(batch, -1, dim)


def real_positions(x: jax.Array, chunk_size: int) -> jax.Array:
  """[batch, chunks * (S + 1), ...] -> [batch, chunks * S, ...]: the landmark positions dropped."""
  batch, positions = x.shape[:2]
  chunked = x.reshape(batch, positions // (chunk_size + 1), chunk_size + 1, *x.shape[2:])
  return chunked[:, :, :chunk_size].reshape(batch, -1, *x.shape[2:])


def serve_next_chunk(indices: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Chunk t's retrieval serves chunk t + 1: shift [batch, chunks, k] one chunk later;
  chunk 0 gets index 0 with weight 0 (no GCA)."""
  shift = lambda a: jnp.pad(a, ((0, 0), (1, 0), (0, 0)))[:, :-1]
  return shift(indices), shift(weights)


def select(
  options: DRTOptions,
  scores: jax.Array,
  top_k: int,
  rng: jax.Array | None,
  *,
  group: int = 0,
  query_chunks: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The chunks a group retrieves and their GCA weights.

  Args:
    options: the model's; `options.retriever` decides how the chunks are chosen.
    scores: float32 [batch, query_chunks, memory_chunks], `retrieval_scores` (-inf where
      a memory chunk is not earlier than the query chunk).
    top_k: chunks per query chunk (at most memory_chunks).
    rng: training noise (the "gumbel" RNG stream), or None (evaluation and decoding).
    group: the retrieval group (the random retriever's draw outside training).
    query_chunks: int [query_chunks], the chunk number of each row of `scores` (default
      0, 1, ...; decoding scores a few new chunks against every landmark so far).

  Returns:
    (indices int32 [batch, query_chunks, top_k], weights float32 [batch, query_chunks,
    top_k]); slots with no earlier chunk have index 0 and weight 0.

  "learned": `select_chunks` (top-k of the scores, Gumbel noise before it in training when
  options.gumbel). "random": the paper's control, "We pick top-k chunks randomly but still
  keep GCA learnable" (Sec. 4.1.2, ablations). The chunks are the top-k of random
  priorities over the earlier chunks, a uniformly random k-subset drawn without looking at
  the scores; the weights stay the softmax of the chosen chunks' relevance scores (Eq. 2),
  so GCA and the scores keep learning as in DRT and only the choice of chunks is taken from
  the retriever. (Uniform weights would cut the scores off from the loss, changing two
  things at once.) In training the priorities are Gumbel noise from `rng`, a fresh draw
  per step and batch row, as the learned retriever's noise is. Outside training they come
  from the fixed key RANDOM_RETRIEVER_EVAL_SEED folded with the group, the query chunk's
  number and the memory chunk's number (`position_priorities`): an evaluation is
  reproducible, a prompt's draw does not depend on the batch it is in, and the batch
  forward pass and `DRTStream` (whose landmark store is wider) pick the same chunks.
  """
  if options.retriever == "learned":
    return select_chunks(scores, top_k, gumbel_rng=rng if options.gumbel else None)
  if rng is not None:
    priorities = jax.random.gumbel(rng, scores.shape, jnp.float32)
  else:
    if query_chunks is None:
      query_chunks = jnp.arange(scores.shape[1], dtype=jnp.int32)
    priorities = position_priorities(group, query_chunks, scores.shape[-1])[None]
  allowed = jnp.isfinite(scores)
  _, indices = jax.lax.top_k(jnp.where(allowed, priorities, -jnp.inf), top_k)
  selected = jnp.take_along_axis(scores, indices, axis=-1)
  valid = jnp.isfinite(selected)
  weights = jax.nn.softmax(jnp.where(valid, selected, -1e30), axis=-1) * valid
  return jnp.where(valid, indices, 0).astype(jnp.int32), weights.astype(jnp.float32)


def position_priorities(group: int, query_chunks: jax.Array, memory_chunks: int) -> jax.Array:
  """The random retriever's priorities outside training: float32 [len(query_chunks),
  memory_chunks], entry (i, c) uniform in [0, 1) from key(RANDOM_RETRIEVER_EVAL_SEED)
  folded with `group`, query_chunks[i] and c. One key per entry (not one draw of the
  whole matrix), so an entry does not depend on how many memory chunks the caller holds."""
  base = jax.random.fold_in(jax.random.key(RANDOM_RETRIEVER_EVAL_SEED), group)

  def draw(query, memory):
    return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(base, query), memory))

  memory = jnp.arange(memory_chunks, dtype=jnp.int32)
  return jax.vmap(jax.vmap(draw, in_axes=(None, 0)), in_axes=(0, None))(query_chunks.astype(jnp.int32), memory)


def retrieval_scale(config: ModelConfig) -> float:
  return config.d_model**-0.5


class DRT(nn.Module):
  """The Differentiable Retrieval Transformer LM (window: model.sliding_window).

  Call with tokens int [batch, seq] to get float32 logits [batch, seq, vocab] (and None:
  the cache slot of the decoder interface). `train=True` draws the Gumbel noise of the
  retrieval (and the random retriever's choice) from the "gumbel" RNG stream. Decoding
  streams through `castle_jax.models.drt_decoding.DRTStream` (chunk memory in host RAM).
  """

  config: ModelConfig
  options: DRTOptions

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, caches=None, *, train: bool = False):
    cfg, opt = self.config, self.options
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be int [batch, seq], got shape {tokens.shape}")
    if caches is not None:
      raise ValueError(
        "DRT decodes through castle_jax.models.drt_decoding.DRTStream (its chunk memory lives "
        "in host RAM), not through caches; call without caches"
      )
    del positions  # ALiBi and the landmark layout define the positions
    groups = opt.upper_layer_groups(cfg.n_layers)
    batch, seq = tokens.shape
    size = opt.chunk_size
    padded = -(-seq // size) * size
    num_chunks = padded // size
    tokens = jnp.pad(tokens, ((0, 0), (0, padded - seq)))

    embed = token_embedding(cfg, "embed")
    landmark = self.param(
      "landmark", with_axes(nn.initializers.normal(cfg.init_std), ("embed",)), (cfg.d_model,), cfg.weights_dtype
    )
    x = insert_landmarks(embed(tokens), landmark, size)
    x = constrain(x, ("batch", "act_length", "act_embed"))
    block = rematerialized(DRTBlock, cfg)

    lower = cfg.n_layers // 2
    for layer in range(lower):
      x, _ = block(cfg, name=f"block_{layer}")(x)

    landmarks, memory_k, memory_v = ChunkMemory(cfg, opt, name="chunk_memory")(
      x.reshape(batch, num_chunks, size + 1, cfg.d_model)
    )
    top_k = min(opt.top_k, num_chunks)
    layer = lower
    for group, group_layers in enumerate(groups):
      states = norm(cfg, f"retrieval_norm_{group}")(x.reshape(batch, num_chunks, size + 1, cfg.d_model)[:, :, size])
      scores = retrieval_scores(states, landmarks, scale=retrieval_scale(cfg))
      noise = self.make_rng("gumbel") if train and (opt.gumbel or opt.retriever == "random") else None
      indices, weights = select(opt, scores, top_k, noise, group=group)
      served_indices, served_weights = serve_next_chunk(indices, weights)
      memory = (memory_k, memory_v, served_weights, served_indices)
      for _ in range(group_layers):
        x, _ = block(cfg, cross_attention=True, gca_output=opt.gca_output, name=f"block_{layer}")(x, memory)
        layer += 1

    x = real_positions(norm(cfg, "final_norm")(x), size)[:, :seq]
    logits = embed.attend(x) if cfg.tie_embeddings else lm_head(cfg, "lm_head")(x)
    return constrain(logits.astype(jnp.float32), ("batch", "act_length", "act_vocab")), None


# The model-family entry (castle_jax.models.registry): what the trainer needs.


def build(config: ModelConfig) -> DRT:
  return DRT(config, DRTOptions.from_config(config))


def token_losses(model: DRT, params, batch, pad_id: int, rng: jax.Array | None = None):
  """Next-token losses of the real tokens (landmarks never reach the logits); Gumbel noise
  from `rng` in training, none in evaluation (rng None)."""
  logits, _ = model.apply(
    {"params": params}, batch["inputs"], train=rng is not None, rngs=None if rng is None else {"gumbel": rng}
  )
  return next_token_losses(logits, batch["targets"], pad_id)


def param_count(config: ModelConfig) -> int:
  """Exact, from the shapes `init` creates (traced, nothing allocated)."""
  model = build(config)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, model.options.chunk_size), jnp.int32)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(shapes)))


def training_flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Forward + backward FLOPs per real token (x3 the forward), for MFU.

  Every matrix runs on (S + 1) / S positions per real token (the landmark), the chunk
  encoder's too; the embedding table is a lookup (the tied LM head is the matmul).
  Attention cores: each position's visible ALiBi-window keys (`mean_visible_keys`) in every
  layer and the encoder's S + 1 keys; GCA in every upper layer over k chunks of S keys
  (2 products of head_dim each); retrieval scores (chunks^2 / 2 dot products of d_model
  per group) are included.
  """
  options = DRTOptions.from_config(config)
  size, d = options.chunk_size, config.d_model
  per_position = (size + 1) / size
  matmul_params = param_count(config) - config.vocab_size * d * (0 if config.tie_embeddings else 1)
  positions = -(-seq_len // size) * (size + 1)
  window = mean_visible_keys(positions, config.sliding_window)
  core = 4 * config.n_heads * config.qk_head_dim
  upper = config.n_layers - config.n_layers // 2
  attention = core * (
    config.n_layers * window
    + options.encoder_layers * (size + 1)
    + upper * min(options.top_k, positions // (size + 1)) * size
  )
  retrieval = options.retrieval_groups * (positions // (size + 1)) / 2 * 2 * d / size
  return 3 * (2 * matmul_params * per_position + per_position * attention + retrieval)
