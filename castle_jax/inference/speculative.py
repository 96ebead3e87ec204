"""Lossless speculative decoding with a LongSpec draft (Yang et al., Sec. 3.3 and App. E).

One round, after the committed tokens are in the target's KV cache and the draft's ring,
with the root (the last committed token, not yet run through the target) at position P:

  draft    level 1: the draft's top-n1 tokens after the root; level l + 1: one draft
           forward over level l's nodes, every (node, token) scored by its cumulative
           log-probability, the global top-n_{l+1} kept (tree shape [4, 16, 16, 16, 16]
           by default: 68 nodes). Nodes that fall out of the top-n simply get no children
           (no cache movement). The draft's cross-attention reads the target's last-layer
           cache; its own memory is a ring of W positions.
  verify   one target forward over [root ; nodes], positions P + depth, each node seeing
           the cache, its ancestors and itself (`TreeVerification`): the cache part needs
           no mask, the tree part a small one, merged by log-sum-exp (hybrid tree attention,
           `castle_jax.ops.tree_attention`).
  accept   greedy (temperature 0): the deepest node whose every token is the target's
           argmax after its parent, then the target's argmax after it (the bonus token);
           the output equals greedy decoding with the target alone.
           sampling: at each accepted node, its children in order, child c accepted with
           probability p(c) under the target's (filtered) distribution p, else p(c) := 0
           and p renormalized; when no child is accepted the bonus is drawn from what is
           left of p (SpecInfer's multi-candidate rule for deterministic candidates:
           every emitted token is distributed exactly as the target's sample).
  commit   the root's and the accepted nodes' keys/values go into the target's cache and
           the draft's ring (a padded gather of depth + 1 entries); the bonus is the next root.

The whole generation is one compiled `lax.while_loop` over a batch of prompts. Every row
drafts its own tree and accepts its own path, so rows grow apart: the target's caches and
the draft's ring keep one length per row, each row's tree sits at its own positions, and a
row that has its max_new_tokens commits nothing more while the others go on; the loop ends
when every row is done. Prompts of different lengths use the same per-row lengths from the
start: each row's prompt sits at columns 0 .. its length - 1 (positions from 0), the pad
columns after it are prefilled but lie past the row's cache length (empty slots, masked out
of every attention and overwritten by the row's first commits), so each row decodes as it
would alone. `trace_speculation` runs the same rounds one at a time from Python (batch 1)
and keeps each round's tree and verdict, to look at them.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.config import ModelConfig
from castle_jax.inference.generate import append_new_tokens, prefill_caches
from castle_jax.inference.sampling import filtered_logits, padded_prompt, validate_request
from castle_jax.layers.mha import TreeVerification
from castle_jax.models import longspec_draft
from castle_jax.models.longspec_draft import DraftSelfCache, LongSpecDraft, draft_logits, embed_tokens

DEFAULT_TREE = (4, 16, 16, 16, 16)


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """Nodes kept per draft level; node 0 is the root, then level 1's nodes, level 2's, ...

  Attributes:
    widths: n_l for levels 1 .. D (a chain: (1, 1, 1, 1)).
  """

  widths: tuple[int, ...] = DEFAULT_TREE

  def __post_init__(self):
    if not self.widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.widths):
      raise ValueError(f"tree must be a non-empty sequence of ints >= 1 (nodes per level), got {self.widths!r}")

  @property
  def depth(self) -> int:
    return len(self.widths)

  @property
  def nodes(self) -> int:
    """The root and every drafted node."""
    return 1 + sum(self.widths)

  def level_start(self, level: int) -> int:
    """Index of the first node of `level` (0: the root)."""
    return 1 + sum(self.widths[: level - 1]) if level else 0

  def level_size(self, level: int) -> int:
    return self.widths[level - 1] if level else 1

  def depths(self) -> np.ndarray:
    return np.concatenate([[0]] + [np.full(w, level + 1) for level, w in enumerate(self.widths)]).astype(np.int32)


@dataclasses.dataclass
class SpeculativeResult:
  """What `speculative_generate` returns.

  Attributes:
    tokens: int32 [batch, prompt_len + max_new_tokens], each row's prompt and its new
      tokens; with prompts of different lengths prompt_len is the longest, and row i holds
      its prompt_lengths[i] prompt tokens, its max_new_tokens new tokens, then zeros.
    row_tokens_per_round: int [batch, rounds], tokens each row's verification emitted in
      each round (accepted + bonus; a row's last round cut at max_new_tokens, 0 once the
      row is done).
    caches: the target's per-layer KV caches after the last round, one length per row:
      every emitted token but the last (the next round's root) is in them, possibly a few
      past max_new_tokens.
    draft_cache: the draft's self-attention state (its ring holds the same tokens' last
      positions, per row).
    prompt_lengths: int [batch], each row's prompt length.
  """

  tokens: jax.Array
  row_tokens_per_round: np.ndarray
  caches: Any = None
  draft_cache: DraftSelfCache | None = None
  prefill_seconds: float = 0.0
  decode_seconds: float = 0.0
  prompt_lengths: np.ndarray | None = None

  @property
  def new_tokens(self) -> np.ndarray:
    """int32 [batch, max_new_tokens]: each row's new tokens (host array)."""
    tokens, lengths = np.asarray(self.tokens), np.asarray(self.prompt_lengths)
    new = tokens.shape[1] - int(lengths.max())
    return tokens[np.arange(tokens.shape[0])[:, None], lengths[:, None] + np.arange(new)]

  @property
  def tokens_per_round(self) -> np.ndarray:
    """int [rounds]: tokens emitted by each target forward, summed over the rows."""
    return self.row_tokens_per_round.sum(axis=0)

  @property
  def tokens_per_second(self) -> float:
    """New tokens of every row over the decoding time (prefill excluded; the first call
    includes compilation)."""
    return float(self.row_tokens_per_round.sum()) / self.decode_seconds if self.decode_seconds else 0.0

  @property
  def rounds(self) -> int:
    """Target forwards (each verifies every row that is not done)."""
    return int(self.row_tokens_per_round.shape[1])

  @property
  def row_rounds(self) -> np.ndarray:
    """int [batch]: the rounds in which each row was verified (it emits >= 1 token in each)."""
    return np.count_nonzero(self.row_tokens_per_round, axis=1)

  @property
  def row_mean_accepted(self) -> np.ndarray:
    """float [batch]: each row's tau, its tokens per verification."""
    return self.row_tokens_per_round.sum(axis=1) / np.maximum(self.row_rounds, 1)

  @property
  def mean_accepted(self) -> float:
    """tau: mean tokens per row verification over every row and round (at batch 1, tokens
    per target forward; a row's last round may be cut at max_new_tokens)."""
    verified = int(self.row_rounds.sum())
    return float(self.row_tokens_per_round.sum()) / verified if verified else 0.0


def check_pair(target_config: ModelConfig, draft_config: ModelConfig) -> None:
  """The draft must be a LongSpec draft whose widths are the target's; the target an `mha`
  RoPE transformer with full causal attention."""
  if draft_config.family != longspec_draft.FAMILY:
    raise ValueError(f"the draft must be a {longspec_draft.FAMILY!r} model, got family {draft_config.family!r}")
  if target_config.family != "transformer":
    raise ValueError(f"the target must be a 'transformer' model, got family {target_config.family!r}")
  longspec_draft.check_target_config(target_config)
  differing = longspec_draft.width_differences(target_config, draft_config)
  if differing:
    raise ValueError(f"the draft was built for another target: {'; '.join(differing)}")


def speculative_generate(
  target_model,
  target_params: Any,
  draft_model: LongSpecDraft,
  draft_params: Any,
  prompt: jax.Array | list,
  *,
  max_new_tokens: int,
  prompt_lengths: Any = None,
  tree: tuple[int, ...] = DEFAULT_TREE,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  rng: jax.Array | None = None,
  tree_attention_impl: str | None = None,
  prefill_chunk: int = 2048,
) -> SpeculativeResult:
  """Continues a prompt with the target's distribution, drafting with a LongSpec draft.

  Args:
    target_model: the target (`TransformerLM` with `mha` attention); target_params its
      parameters (also the draft's embedding and head).
    draft_model: a `LongSpecDraft` built for this target; draft_params its parameters.
    prompt: int [batch, prompt_len] (batch >= 1, prompt_len >= 1), or a list of batch
      token sequences of any lengths >= 1 (each a list or an int [length] array).
    max_new_tokens: tokens to append to each row (>= 1).
    prompt_lengths: with an int [batch, prompt_len] prompt, int [batch]: row i's prompt is
      prompt[i, :prompt_lengths[i]] (what follows is padding, ignored). None: every row
      fills prompt_len, or, for a list, each sequence's own length.
    tree: nodes per draft level (default [4, 16, 16, 16, 16]; a chain: [1, 1, 1, 1]).
    temperature, top_k, top_p: the target's sampling (`sample_next_token`); 0 is greedy,
      and then each row equals `generate(target_model, ...)` of that row token for token.
    rng: PRNG key (required when temperature > 0); at batch > 1 each round's key is split
      into one key per row.
    tree_attention_impl: the verification's `tree_attention` implementation (None: default).
    prefill_chunk: the prompt enters the target's cache this many tokens at a time.

  Returns:
    SpeculativeResult (tokens, tokens per round and row, tau per row and overall).
  """
  shape, prompt, lengths = _check_request(
    target_model,
    draft_model,
    prompt,
    prompt_lengths,
    max_new_tokens,
    tree,
    temperature,
    top_k,
    top_p,
    rng,
    prefill_chunk,
  )
  start = time.perf_counter()
  caches, draft_cache = _prefill(
    target_model, target_params, draft_model, draft_params, prompt, lengths, max_new_tokens, shape, prefill_chunk
  )
  prefilled = time.perf_counter()
  rng = jax.random.key(0) if rng is None else rng
  new_tokens, emitted_per_round, rounds, caches, draft_cache = jax.block_until_ready(
    _speculate(
      target_model,
      draft_model,
      shape,
      float(temperature),
      int(top_k),
      float(top_p),
      tree_attention_impl,
      int(max_new_tokens),
      target_params,
      draft_params,
      caches,
      draft_cache,
      prompt[jnp.arange(prompt.shape[0]), lengths - 1],
      rng,
    )
  )
  decoded = time.perf_counter()
  counts = np.array(jax.device_get(emitted_per_round))[:, : int(rounds)]
  # A row's rounds are a prefix (it emits >= 1 token in each until done); its last one
  # may overshoot max_new_tokens.
  last = np.count_nonzero(counts, axis=1) - 1
  counts[np.arange(counts.shape[0]), last] -= counts.sum(axis=1) - max_new_tokens
  return SpeculativeResult(
    append_new_tokens(prompt, lengths, new_tokens[:, :max_new_tokens]),
    counts,
    caches,
    draft_cache,
    prefilled - start,
    decoded - prefilled,
    lengths,
  )


@dataclasses.dataclass(frozen=True)
class DraftedRound:
  """One round of speculative decoding as it happened: the drafted tree and what the target
  made of it (host arrays).

  Attributes:
    position: the root's position (the number of tokens in the target's cache before it).
    tokens: int32 [nodes], node 0 the root (the last committed token), then level 1's
      nodes, level 2's, ... (`TreeShape`'s order).
    parents: int32 [nodes], each node's parent index (-1 for the root).
    target_next: int32 [nodes], the target's argmax after each node's branch (the cache,
      the node's ancestors and the node itself) from the verification forward.
    path: int32 [kept], the accepted nodes from the root down (the root first).
    emitted: int32 [kept], the tokens the round appended: the accepted drafted tokens, then
      the bonus token (the target's own choice after the last accepted node).
  """

  position: int
  tokens: np.ndarray
  parents: np.ndarray
  target_next: np.ndarray
  path: np.ndarray
  emitted: np.ndarray

  @property
  def kept(self) -> int:
    """Tokens emitted by this round's target forward (accepted drafts + the bonus)."""
    return int(self.path.size)


@dataclasses.dataclass
class SpeculativeTrace:
  """What `trace_speculation` returns.

  Attributes:
    tokens: int32 [1, prompt_len + max_new_tokens], as `speculative_generate` returns them.
    rounds: the rounds in order; the last one's `emitted` may run past max_new_tokens.
    prompt_len: the prompt's length.
  """

  tokens: jax.Array
  rounds: list[DraftedRound]
  prompt_len: int

  @property
  def tokens_per_round(self) -> np.ndarray:
    """int [rounds], `SpeculativeResult.tokens_per_round`: the last round cut at max_new_tokens."""
    counts = np.array([drafted.kept for drafted in self.rounds])
    counts[-1] -= int(counts.sum()) - (self.tokens.shape[1] - self.prompt_len)
    return counts

  @property
  def mean_accepted(self) -> float:
    """tau, as `SpeculativeResult.mean_accepted`."""
    return float(self.tokens_per_round.mean())


def trace_speculation(
  target_model,
  target_params: Any,
  draft_model: LongSpecDraft,
  draft_params: Any,
  prompt: jax.Array | list,
  *,
  max_new_tokens: int,
  prompt_lengths: Any = None,
  tree: tuple[int, ...] = DEFAULT_TREE,
  temperature: float = 0.0,
  top_k: int = 0,
  top_p: float = 1.0,
  rng: jax.Array | None = None,
  tree_attention_impl: str | None = None,
  prefill_chunk: int = 2048,
) -> SpeculativeTrace:
  """`speculative_generate` one round at a time from Python, keeping every round's drafted
  tree and verdict, for inspection and plots.

  Each round is the compiled loop's own round function (`_round`), jitted on its own, with
  the same arguments and random keys, so the tokens are those of `speculative_generate`
  with the same inputs. It pays a host round trip per round: use it to look at the
  algorithm, `speculative_generate` to run it.

  Args: as `speculative_generate`, with one prompt (batch 1).

  Returns:
    SpeculativeTrace (tokens, the rounds).
  """
  shape, prompt, lengths = _check_request(
    target_model,
    draft_model,
    prompt,
    prompt_lengths,
    max_new_tokens,
    tree,
    temperature,
    top_k,
    top_p,
    rng,
    prefill_chunk,
  )
  if prompt.shape[0] != 1:
    raise ValueError(
      f"trace_speculation traces one prompt, got a prompt batch of {prompt.shape[0]}: "
      "pass prompt[i : i + 1] for the row to look at"
    )
  prompt = prompt[:, : lengths[0]]
  caches, draft_cache = _prefill(
    target_model, target_params, draft_model, draft_params, prompt, lengths, max_new_tokens, shape, prefill_chunk
  )
  rng = jax.random.key(0) if rng is None else rng
  root, position = prompt[:, -1], caches[0].length
  active = jnp.ones((1,), bool)
  rounds, emitted_count = [], 0
  while emitted_count < max_new_tokens:
    rng, accept_rng = jax.random.split(rng)
    outcome, caches, draft_cache = _traced_round(
      target_model,
      draft_model,
      shape,
      float(temperature),
      int(top_k),
      float(top_p),
      tree_attention_impl,
      target_params,
      draft_params,
      caches,
      draft_cache,
      root,
      position,
      active,
      accept_rng,
    )
    kept = int(outcome.kept[0])
    rounds.append(
      DraftedRound(
        position=int(position[0]),
        tokens=np.asarray(outcome.tokens[0]),
        parents=np.asarray(outcome.parents[0]),
        target_next=np.asarray(jnp.argmax(outcome.logits[0], axis=-1), np.int32),
        path=np.asarray(outcome.path[0, :kept]),
        emitted=np.asarray(outcome.emitted[0, :kept]),
      )
    )
    root, position, emitted_count = outcome.bonus, position + outcome.kept, emitted_count + kept
  new_tokens = np.concatenate([drafted.emitted for drafted in rounds])[:max_new_tokens]
  return SpeculativeTrace(
    jnp.concatenate([prompt, jnp.asarray(new_tokens, jnp.int32)[None]], axis=1), rounds, prompt.shape[1]
  )


def _check_request(
  target_model, draft_model, prompt, prompt_lengths, max_new_tokens, tree, temperature, top_k, top_p, rng, prefill_chunk
) -> tuple[TreeShape, jax.Array, np.ndarray]:
  """The tree's shape, the validated prompt int32 [batch, prompt_len] (rows padded at the
  end) and each row's length int32 [batch]; ValueError on a bad request."""
  shape = TreeShape(tuple(tree))
  prompt, lengths = padded_prompt(prompt, prompt_lengths)
  prompt = validate_request(prompt, max_new_tokens, temperature, top_k, top_p, rng)
  if prompt.shape[0] < 1:
    raise ValueError(f"prompt batch must be >= 1, got prompt of shape {prompt.shape}: pass at least one prompt row")
  lengths = np.full(prompt.shape[0], prompt.shape[1], np.int32) if lengths is None else lengths
  vocab = target_model.config.vocab_size
  tokens = np.asarray(prompt)
  outside = (tokens < 0) | (tokens >= vocab)
  outside &= np.arange(tokens.shape[1]) < lengths[:, None]
  if outside.any():
    row, column = (int(i) for i in np.argwhere(outside)[0])
    raise ValueError(
      f"prompt row {row} holds token {int(tokens[row, column])} at column {column}, outside the target's "
      f"vocabulary [0, {vocab}): pass token ids of the target's tokenizer"
    )
  if prefill_chunk < 1:
    raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
  check_pair(target_model.config, draft_model.config)
  window = draft_model.options.window
  if shape.depth >= window:
    raise ValueError(
      f"tree depth {shape.depth} must be below the draft's window ({window}): the deepest node must still see the root"
    )
  for level, width in enumerate(shape.widths, start=1):
    continuations = shape.level_size(level - 1) * target_model.config.vocab_size
    if width > continuations:
      raise ValueError(
        f"tree level {level} keeps {width} nodes, more than the {continuations} distinct "
        "continuations it can have; narrow the tree"
      )
  return shape, prompt, lengths


def _prefill(
  target_model,
  target_params,
  draft_model,
  draft_params,
  prompt,
  lengths,
  max_new_tokens,
  shape: TreeShape,
  prefill_chunk,
):
  """(target caches, draft cache) holding each row's prompt tokens but its last, the first
  root, with one length per row (lengths int32 [batch] - 1); the target's caches sized
  for the whole request and one round's overshoot. Pad columns are prefilled too (after a
  row's tokens, they change none of its entries) but lie past the row's length."""
  capacity = prompt.shape[1] + max_new_tokens + shape.depth + 1
  committed = np.asarray(lengths, np.int32) - 1
  caches = prefill_caches(target_model, target_params, prompt[:, :-1], capacity, chunk=prefill_chunk)
  caches = [cache.replace(length=jnp.asarray(committed)) for cache in caches]
  draft_cache = _prefill_draft(
    draft_model, draft_params, target_model.config, target_params, prompt[:, :-1], committed, shape
  )
  return jax.block_until_ready((caches, draft_cache))


def _prefill_draft(draft: LongSpecDraft, params, target_config, target_params, tokens, committed, shape: TreeShape):
  """The draft's ring (per row) holding the last of each row's committed tokens
  tokens[i, :committed[i]] (tokens [batch, L], L and the counts may be 0)."""
  cache = DraftSelfCache.create(draft.config, tokens.shape[0], draft.options.window, shape.nodes, shape.depth + 1)
  cache = cache.replace(ring=cache.ring.per_row())
  keep = min(tokens.shape[1], cache.ring.capacity)
  if keep == 0:
    return cache
  start = np.maximum(committed - keep, 0)
  window = jnp.take_along_axis(tokens, jnp.asarray(start[:, None] + np.arange(keep)), axis=1)
  return _fill_ring(
    draft, target_config, params, target_params, window, jnp.asarray(start), jnp.asarray(committed - start), cache
  )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _fill_ring(draft, target_config, params, target_params, tokens, start, count, cache):
  """The cache with row i's first count[i] tokens of tokens [batch, n] (positions start[i] ..)
  as its ring's newest entries (a per-row ring)."""
  positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
  keys, values = draft.apply(
    {"params": params},
    embed_tokens(target_config, target_params, tokens),
    positions,
    method=LongSpecDraft.self_keys_values,
  )
  return cache.replace(ring=cache.ring.replace(length=start).append(keys, values, count=count))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _speculate(
  target_model,
  draft,
  shape: TreeShape,
  temperature,
  top_k,
  top_p,
  tree_impl,
  max_new_tokens,
  target_params,
  draft_params,
  caches,
  draft_cache,
  root,
  rng,
):
  """From the roots int32 [batch]: (new tokens int32 [batch, max_new + depth + 1], tokens
  per round int32 [batch, max_new] (0 once a row is done), rounds, target caches, draft
  cache). Each active row emits >= 1 token a round, so max_new rounds finish every row."""
  batch = root.shape[0]
  width = max_new_tokens + shape.depth + 1
  buffer = jnp.zeros((batch, width), jnp.int32)
  per_round = jnp.zeros((batch, max_new_tokens), jnp.int32)
  position = caches[0].length
  rows = jnp.arange(batch)[:, None]
  offsets = jnp.arange(shape.depth + 1)

  def round_(carry):
    caches, draft_cache, root, position, buffer, count, per_round, rounds, rng = carry
    rng, accept_rng = jax.random.split(rng)
    active = count < max_new_tokens
    outcome, caches, draft_cache = _round(
      target_model,
      draft,
      shape,
      temperature,
      top_k,
      top_p,
      tree_impl,
      target_params,
      draft_params,
      caches,
      draft_cache,
      root,
      position,
      active,
      accept_rng,
    )
    # A done row's count may sit near the buffer's end: entries past `kept` are dropped.
    slots = jnp.where(offsets < outcome.kept[:, None], count[:, None] + offsets, width)
    buffer = buffer.at[rows, slots].set(outcome.emitted, mode="drop")
    per_round = per_round.at[:, rounds].set(outcome.kept)
    return (
      caches,
      draft_cache,
      jnp.where(active, outcome.bonus, root),
      position + outcome.kept,
      buffer,
      count + outcome.kept,
      per_round,
      rounds + 1,
      rng,
    )

  count = jnp.zeros((batch,), jnp.int32)
  carry = (caches, draft_cache, root, position, buffer, count, per_round, jnp.int32(0), rng)
  carry = jax.lax.while_loop(lambda c: jnp.any(c[5] < max_new_tokens), round_, carry)
  return carry[4], carry[6], carry[7], carry[0], carry[1]


class _RoundOutcome(NamedTuple):
  """One round's trees and verdicts, a row each (device arrays; see `DraftedRound` for
  their meaning)."""

  tokens: jax.Array  # int32 [batch, nodes]
  parents: jax.Array  # int32 [batch, nodes]
  logits: jax.Array  # float32 [batch, nodes, V], the target's
  path: jax.Array  # int32 [batch, depth + 1], padded with 0 past `kept`
  kept: jax.Array  # int32 [batch], 0 for a row that was not active
  bonus: jax.Array  # int32 [batch]
  emitted: jax.Array  # int32 [batch, depth + 1], padded past `kept`


def _round(
  target_model,
  draft,
  shape: TreeShape,
  temperature,
  top_k,
  top_p,
  tree_impl,
  target_params,
  draft_params,
  caches,
  draft_cache,
  root,
  position,
  active,
  accept_rng,
):
  """One round (draft, verify, accept, commit; see the module docstring) from the roots
  int32 [batch] at positions int32 [batch]; rows where `active` (bool [batch]) is False
  commit nothing. -> (`_RoundOutcome`, target caches, draft cache)."""
  target_config = target_model.config
  batch = root.shape[0]
  tokens, parents, ancestors, draft_cache = _draft_tree(
    draft, shape, draft_params, target_config, target_params, caches[-1], draft_cache, root, position
  )
  positions = position[:, None] + jnp.asarray(shape.depths())[None]
  logits, pending = target_model.apply(
    {"params": target_params}, tokens, positions, caches, TreeVerification(ancestors, tree_impl)
  )
  if temperature == 0.0:
    path, kept, bonus = jax.vmap(functools.partial(_accept_greedy, shape))(tokens, parents, ancestors, logits)
  else:
    # A single row draws from the round's key itself, so a one-prompt call's samples do not
    # depend on how a batch would split keys.
    row_rngs = accept_rng[None] if batch == 1 else jax.random.split(accept_rng, batch)
    accept = functools.partial(_accept_sampling, shape, temperature=temperature, top_k=top_k, top_p=top_p)
    path, kept, bonus = jax.vmap(accept)(tokens, parents, logits, row_rngs)
  kept = jnp.where(active, kept, 0)
  gather = lambda x: jnp.take_along_axis(x, path[:, :, None, None], axis=1)
  caches = [cache.append(gather(kv.keys), gather(kv.values), count=kept) for cache, kv in zip(caches, pending)]
  # The draft's entries depend on the token and position alone; the deepest level's
  # nodes never ran through the draft, so the path's entries are computed here.
  path_tokens = jnp.take_along_axis(tokens, path, axis=1)
  path_keys, path_values = draft.apply(
    {"params": draft_params},
    embed_tokens(target_config, target_params, path_tokens),
    position[:, None] + jnp.arange(shape.depth + 1, dtype=jnp.int32)[None],
    method=LongSpecDraft.self_keys_values,
  )
  draft_cache = draft_cache.replace(ring=draft_cache.ring.append(path_keys, path_values, count=kept))
  # Emitted: the accepted nodes' tokens (path[1:kept]) then the bonus.
  accepted_tokens = jnp.concatenate([path_tokens[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)
  emitted = jnp.where(jnp.arange(shape.depth + 1)[None] == kept[:, None] - 1, bonus[:, None], accepted_tokens)
  return _RoundOutcome(tokens, parents, logits, path, kept, bonus, emitted), caches, draft_cache


# `_round` compiled on its own (static: the models, the tree and the sampling settings).
_traced_round = jax.jit(_round, static_argnums=(0, 1, 2, 3, 4, 5, 6))


def _draft_tree(
  draft, shape: TreeShape, draft_params, target_config, target_params, target_cache, draft_cache, root, position
):
  """Drafts one tree per row from the roots int32 [batch] at positions int32 [batch].
  Returns (tokens int32 [batch, nodes], parents int32 [batch, nodes] (-1 for the root),
  ancestors bool [batch, nodes, nodes] (node i sees node j), the draft cache with every
  drafted node's self-attention entry)."""
  nodes, batch = shape.nodes, root.shape[0]
  tokens = jnp.zeros((batch, nodes), jnp.int32).at[:, 0].set(root)
  parents = jnp.full((batch, nodes), -1, jnp.int32)
  ancestors = jnp.zeros((batch, nodes, nodes), bool).at[:, 0, 0].set(True)
  cumulative = jnp.zeros((batch, 1), jnp.float32)  # log-probability of each node of the current level
  keys, values = target_cache.keys, target_cache.values
  for level in range(shape.depth):
    start, size = shape.level_start(level), shape.level_size(level)
    slots = jnp.arange(start, start + size)
    h = embed_tokens(target_config, target_params, tokens[:, start : start + size])
    positions = jnp.broadcast_to(position[:, None] + level, (batch, size)).astype(jnp.int32)
    out, draft_cache = draft.apply(
      {"params": draft_params},
      h,
      positions,
      draft_cache,
      slots,
      ancestors[:, start : start + size],
      keys,
      values,
      target_cache.length,
      method=LongSpecDraft.draft,
    )
    log_probs = jax.nn.log_softmax(draft_logits(target_config, target_params, out), axis=-1)  # [batch, size, V]
    width = shape.widths[level]
    cumulative, child_parents, child_tokens = _best_children(cumulative[:, :, None] + log_probs, width)
    child_parents = start + child_parents
    child_start = shape.level_start(level + 1)
    children = jnp.arange(child_start, child_start + width)
    tokens = tokens.at[:, children].set(child_tokens)
    parents = parents.at[:, children].set(child_parents)
    parent_rows = jnp.take_along_axis(ancestors, child_parents[:, :, None], axis=1)  # [batch, width, nodes]
    ancestors = ancestors.at[:, children].set(parent_rows | (children[:, None] == jnp.arange(nodes)))
  return tokens, parents, ancestors, draft_cache


def _best_children(scores, width: int):
  """The `width` best (node, token) pairs of scores float32 [batch, size, V], best first,
  ties to the lower flat index node * V + token, as `jax.lax.top_k` over the flattened
  scores orders them. -> (scores float32 [batch, width], node int32 [batch, width] (0 ..
  size - 1), token int32 [batch, width]).

  Each node's top `width` tokens first, then the top `width` of those candidates, so that
  no top_k row is longer than V: XLA's GPU compiler splits top-k rows of 2^20 elements or
  more into batches, which blows its compile time and memory up for some such lengths, and
  the flattened size x V scores of a tree level are one (16 nodes of a 128K vocabulary:
  2,052,096 elements; the round of a Llama-3-8B-shaped pair did not finish compiling).
  The result is the same, ties included: an element of the global top-n is in its node's
  top-n, and the candidates hold equal scores in flat order (nodes in order, each node's
  tokens in order), which top_k's lower-index-first tie-break then keeps.
  """
  batch, _, vocab = scores.shape
  per_node = min(width, vocab)
  node_best, node_tokens = jax.lax.top_k(scores, per_node)  # [batch, size, per_node]
  best, picked = jax.lax.top_k(node_best.reshape(batch, -1), width)
  tokens = jnp.take_along_axis(node_tokens.reshape(batch, -1), picked, axis=1)
  return best, (picked // per_node).astype(jnp.int32), tokens.astype(jnp.int32)


def _path_to(ancestors, node, depth: int):
  """(path int32 [depth + 1]: the root .. node in order, padded with 0; its length)."""
  on_path = ancestors[node]
  path = jnp.nonzero(on_path, size=depth + 1, fill_value=0)[0].astype(jnp.int32)
  return path, jnp.sum(on_path, dtype=jnp.int32)


def _accept_greedy(shape: TreeShape, tokens, parents, ancestors, logits):
  """The deepest node whose path is the target's argmax all the way, and the bonus.
  tokens int32 [nodes], logits float32 [nodes, V] -> (path, kept, bonus int32 scalar)."""
  target_next = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  matches = tokens == target_next[jnp.maximum(parents, 0)]
  matches = matches.at[0].set(True)
  accepted = ~jnp.any(ancestors & ~matches[None, :], axis=-1)
  deepest = jnp.argmax(jnp.where(accepted, jnp.asarray(shape.depths()), -1))
  path, kept = _path_to(ancestors, deepest, shape.depth)
  return path, kept, target_next[deepest]


def _accept_sampling(shape: TreeShape, tokens, parents, logits, rng, temperature, top_k, top_p):
  """Multi-candidate acceptance (see the module docstring): at the current node, each child
  in order is accepted with probability p(child) under the residual target distribution
  p, else p(child) := 0 and p is renormalized; no child accepted (or a leaf): the bonus is
  drawn from p. -> (path, kept, bonus).

  Each level is decided at once, not child by child: a child is tried only after every
  earlier candidate was rejected, so its residual probability is p(child) / (1 - the mass of
  the earlier candidates' tokens), and the first child whose draw falls below that is the one
  the one-by-one rule accepts. A token repeated among the candidates has no mass left the
  second time."""
  probabilities = jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1)  # [nodes, V]
  node = jnp.int32(0)
  stopped = jnp.bool_(False)
  path = jnp.zeros((shape.depth + 1,), jnp.int32)
  residual = probabilities[0]
  level_rngs = jax.random.split(rng, shape.depth + 1)
  for level in range(1, shape.depth + 1):
    start, width = shape.level_start(level), shape.widths[level - 1]
    children = start + jnp.arange(width)
    child_tokens = tokens[children]
    order = jnp.arange(width)
    earlier = order[None, :] < order[:, None]  # [i, j]: j is tried before i
    candidate = (parents[children] == node) & ~stopped
    repeated = jnp.any(earlier & candidate[None, :] & (child_tokens[None, :] == child_tokens[:, None]), axis=1)
    mass = jnp.where(candidate & ~repeated, residual[child_tokens], 0.0)
    left = jnp.sum(residual) - (jnp.cumsum(mass) - mass)  # the residual's mass when child i is tried
    accept = candidate & (jax.random.uniform(level_rngs[level], (width,)) * left < mass)
    advanced = jnp.any(accept)
    first = jnp.argmax(accept)
    chosen = children[first]
    # Stopping here: every candidate was rejected, so the bonus's distribution lacks their tokens.
    rejected = candidate & ~advanced
    stopping_residual = residual.at[child_tokens].multiply(jnp.where(rejected, 0.0, 1.0))
    node = jnp.where(advanced, chosen, node)
    path = path.at[level].set(jnp.where(advanced, chosen, 0))
    residual = jnp.where(advanced, probabilities[chosen], stopping_residual)
    stopped = stopped | ~advanced
  kept = 1 + jnp.sum(path[1:] > 0, dtype=jnp.int32)
  bonus = jax.random.categorical(level_rngs[0], jnp.log(jnp.maximum(residual, 0.0)))
  return path, kept, bonus.astype(jnp.int32)
