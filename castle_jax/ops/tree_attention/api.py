"""Hybrid tree attention for speculative verification: the public entry points.

A target model verifies n drafted tree nodes in one forward pass. Each node's query
attends to the committed KV cache (every filled slot) and to the drafted nodes under
the tree mask (itself and its ancestors, `tree_mask_from_parents`).

`implementation`:
  - "reference": one dense softmax over [cache ; tree] with the concatenated mask
    (`reference.py`, float32 math); a test oracle.
  - "xla": the hybrid form (LongSpec §3.3): cache part without a mask, tree part with
    the n x n mask, merged through their log-sum-exps (`xla.py`).
  - "triton": one Pallas Triton kernel (`pallas_kernels/tree_attention`): split-K
    flash decoding over the filled slots (work follows cache_length, not the capacity)
    with the masked tree tile folded into the last split, partial states merged in XLA.
    Power-of-two head dims >= 16. Runs in interpret mode on CPU (slow: for tests).
    `kernel_config` a `TreeAttentionTritonConfig`.
  - "mosaic": the same on Pallas Mosaic GPU (Hopper: wgmma + TMA), for LLM heads: one
    program reads its cache range once for several 64-row tiles of a KV head's rows
    (`pallas_kernels/tree_attention/mosaic.py`). Hopper GPUs, bfloat16/float16 inputs of one
    dtype, head dim 64 or 128, a cache capacity that is a multiple of 8 (or under one key
    block). Runs in GPU interpret mode on CPU (slow: for tests). `kernel_config` a
    `TreeAttentionMosaicConfig`.
  - None: "mosaic" on a Hopper GPU for the cases where it measured faster than "triton"
    (`MOSAIC_FASTER_CASES`: head dim, dtype and cache capacity; trees of
    `MOSAIC_MIN_TREE_NODES` or more; the reason it passes over it elsewhere is logged
    once at INFO),
    else "triton" on a GPU where it takes the head dim, else "xla"
    (`castle_jax.ops.backend.choose`, logged at debug level).

Inference only: there is no custom VJP, and gradients are neither needed nor tested.

Shapes: q [batch, n, heads, head_dim]; cache_k, cache_v [batch, capacity, kv_heads,
head_dim] (heads % kv_heads == 0, query head h reads kv head h // (heads // kv_heads));
cache_length int32 scalar or [batch] (may be traced under jit); tree_k, tree_v [batch,
n, kv_heads, head_dim]; tree_mask bool [batch, n, n] or [n, n]; out [batch, n, heads,
head_dim] in q's dtype; lse float32 [batch, n, heads] (natural log of the summed
exp(q . k / sqrt(head_dim)) over the visible keys).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from castle_jax.ops.backend import Implementation, choose, rejects_renamed_arguments
from castle_jax.sharding import KV_SEQUENCE_HEADS_AXES, SEQUENCE_HEADS_AXES, map_over_shards
from castle_jax.ops.tree_attention.reference import cache_attention_reference, tree_attention_reference
from castle_jax.ops.tree_attention.xla import cache_attention as split_cache_attention, hybrid_tree_attention
from pallas_kernels import device_facts
from pallas_kernels.tree_attention import (
  TreeAttentionMosaicConfig,
  TreeAttentionTritonConfig,
  mosaic_unsupported_reason,
  supports_head_dim,
  tree_attention_mosaic,
  tree_attention_triton,
)

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic")
_DEFAULT_ORDER = ("mosaic", "triton", "xla")
# (head_dim, dtype name) -> the smallest cache capacity from which "mosaic" measured faster than
# "triton" verifying a tree of at least MOSAIC_MIN_TREE_NODES nodes (`benchmarks/tree_attention.py`,
# benchmarks/RESULTS.md "Hybrid tree attention": LongSpec's 69-node tree). LLM heads of 128 at
# every capacity; heads of 64 from 32K slots (at 8/4 heads it was slower up to 8K and level at 16K).
# Smaller trees (not measured), the cache part alone (a decoding step) and other cases stay on Triton.
MOSAIC_FASTER_CASES = {(128, "bfloat16"): 0, (64, "bfloat16"): 32768}
MOSAIC_MIN_TREE_NODES = 64
# The kernel config type of each kernel implementation (`kernel_config=`).
KERNEL_CONFIGS = {"triton": TreeAttentionTritonConfig, "mosaic": TreeAttentionMosaicConfig}
_KERNELS = {"triton": tree_attention_triton, "mosaic": tree_attention_mosaic}


def _implementations(q: jax.Array, kv_arrays, kernel_config) -> dict[str, Implementation]:
  """The table for these inputs; `kv_arrays`: cache_k, cache_v and (for the tree) tree_k, tree_v."""
  head_dim = q.shape[-1]

  def triton_unsupported() -> str | None:
    if supports_head_dim(head_dim):
      return None
    return f"the kernel needs a power-of-two head_dim >= 16, got {head_dim} (use implementation='xla')"

  tree_nodes = q.shape[1] if len(kv_arrays) > 2 else 0  # 0: the cache part alone

  def mosaic_unsupported() -> str | None:
    reason = mosaic_unsupported_reason(
      head_dim=head_dim,
      dtype=q.dtype,
      kv_dtypes=[x.dtype for x in kv_arrays],
      tree_nodes=tree_nodes,
      capacity=kv_arrays[0].shape[1],
      config=kernel_config if isinstance(kernel_config, TreeAttentionMosaicConfig) else None,
    )
    if reason or jax.default_backend() == "cpu":  # on a CPU the kernel runs in interpret mode
      return reason
    return device_facts.not_hopper_reason(
      device_facts.compute_capability(), "the tree attention Mosaic GPU kernel", "use implementation='triton'"
    )

  return {
    "reference": Implementation(),
    "xla": Implementation(),
    "triton": Implementation(triton_unsupported, default_backends=("gpu",), config_type=TreeAttentionTritonConfig),
    "mosaic": Implementation(
      mosaic_unsupported,
      default_backends=("gpu",),
      config_type=TreeAttentionMosaicConfig,
      default_declines=lambda: mosaic_not_measured_faster(q.dtype, head_dim, tree_nodes, kv_arrays[0].shape[1]),
    ),
  }


def mosaic_not_measured_faster(dtype, head_dim: int, tree_nodes: int, capacity: int) -> str | None:
  """None where the Mosaic kernel measured faster than the Triton one, else why the default
  does not take it; `tree_nodes` 0 for the cache part alone."""
  from_capacity = MOSAIC_FASTER_CASES.get((head_dim, jnp.dtype(dtype).name))
  if from_capacity is not None and tree_nodes >= MOSAIC_MIN_TREE_NODES and capacity >= from_capacity:
    return None
  what = f"a tree of {tree_nodes} nodes" if tree_nodes else "the cache part alone"
  return (
    f"not measured faster than 'triton' for head_dim {head_dim}, {jnp.dtype(dtype).name}, {what}, "
    f"a cache of {capacity} slots (castle_jax.ops.tree_attention.api.MOSAIC_FASTER_CASES, MOSAIC_MIN_TREE_NODES)"
  )


def _kernel(
  q,
  cache_k,
  cache_v,
  cache_length,
  tree_k=None,
  tree_v=None,
  tree_mask=None,
  *,
  implementation: str,
  config: TreeAttentionTritonConfig | TreeAttentionMosaicConfig | None,
):
  """The kernel of `implementation` ("triton" or "mosaic"), per shard of batch rows and heads
  under a device mesh."""
  interpret = jax.default_backend() == "cpu"
  cache_length = jnp.asarray(cache_length, jnp.int32)
  args = [q, cache_k, cache_v, cache_length]
  axes = [
    SEQUENCE_HEADS_AXES,
    KV_SEQUENCE_HEADS_AXES,
    KV_SEQUENCE_HEADS_AXES,
    ("batch",) if cache_length.ndim else None,
  ]
  if tree_k is not None:
    args += [tree_k, tree_v, tree_mask]
    axes += [KV_SEQUENCE_HEADS_AXES, KV_SEQUENCE_HEADS_AXES, ("batch", None, None) if tree_mask.ndim == 3 else None]

  def run(*shard_args):
    return _KERNELS[implementation](*shard_args, config=config, interpret=interpret)

  return map_over_shards(run, args, axes, [SEQUENCE_HEADS_AXES, ("batch", None, "act_heads")], what="tree_attention")


def _check_layout(name: str, x: jax.Array, layout: str) -> None:
  if x.ndim != 4:
    raise ValueError(f"{name} must have shape {layout}; got shape {x.shape}")


def _validate_cache_inputs(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, cache_length) -> None:
  """Shapes and dtypes of the query and cache arguments; the length's range when concrete."""
  _check_layout("q", q, "[batch, n, heads, head_dim]")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be floating point, got dtype {q.dtype}")
  _check_layout("cache_k", cache_k, "[batch, capacity, kv_heads, head_dim]")
  _check_layout("cache_v", cache_v, "[batch, capacity, kv_heads, head_dim]")
  if cache_k.shape != cache_v.shape:
    raise ValueError(
      f"cache_k {cache_k.shape} and cache_v {cache_v.shape} must have the same shape "
      "[batch, capacity, kv_heads, head_dim]"
    )
  batch, _, heads, head_dim = q.shape
  _, capacity, kv_heads, cache_head_dim = cache_k.shape
  if cache_k.shape[0] != batch:
    raise ValueError(f"cache_k batch ({cache_k.shape[0]}) must equal q's batch ({batch})")
  if cache_head_dim != head_dim:
    raise ValueError(f"cache_k/cache_v head_dim ({cache_head_dim}) must equal q's head_dim ({head_dim})")
  if kv_heads < 1 or heads % kv_heads:
    raise ValueError(
      f"q heads ({heads}) must be a multiple of cache_k/cache_v kv_heads ({kv_heads}) for grouped-query attention"
    )
  length = jnp.asarray(cache_length)
  if not jnp.issubdtype(length.dtype, jnp.integer):
    raise ValueError(f"cache_length must be an integer (int32 scalar or [batch]), got dtype {length.dtype}")
  if length.shape not in ((), (batch,)):
    raise ValueError(f"cache_length must be a scalar or have shape [batch] = ({batch},); got shape {length.shape}")
  if not isinstance(length, jax.core.Tracer):
    values = np.asarray(length)
    if (values < 0).any() or (values > capacity).any():
      raise ValueError(
        f"cache_length must lie in 0 .. capacity ({capacity}); got {values.tolist()}: "
        "count only the filled slots of cache_k/cache_v"
      )


def _validate_tree_inputs(
  q: jax.Array, cache_k: jax.Array, tree_k: jax.Array, tree_v: jax.Array, tree_mask: jax.Array
) -> None:
  """Shapes and dtypes of the drafted nodes' arguments (after `_validate_cache_inputs`)."""
  _check_layout("tree_k", tree_k, "[batch, n, kv_heads, head_dim]")
  _check_layout("tree_v", tree_v, "[batch, n, kv_heads, head_dim]")
  batch, n, _, head_dim = q.shape
  expected = (batch, n, cache_k.shape[2], head_dim)
  for name, x in (("tree_k", tree_k), ("tree_v", tree_v)):
    if x.shape != expected:
      raise ValueError(
        f"{name} must have shape [batch, n, kv_heads, head_dim] = {expected} (q's batch, n and "
        f"head_dim, cache_k's kv_heads); got shape {x.shape}"
      )
  if tree_mask.dtype != jnp.bool_:
    raise ValueError(
      f"tree_mask must be bool (True where node i sees node j), got dtype {tree_mask.dtype}; "
      "build it with tree_mask_from_parents"
    )
  if tree_mask.shape not in ((n, n), (batch, n, n)):
    raise ValueError(
      f"tree_mask must have shape [batch, n, n] = ({batch}, {n}, {n}) or [n, n] = ({n}, {n}); "
      f"got shape {tree_mask.shape}"
    )


@rejects_renamed_arguments
def cache_attention(
  q: jax.Array,
  cache_k: jax.Array,
  cache_v: jax.Array,
  cache_length: jax.Array,
  *,
  implementation: str | None = None,
  kernel_config: TreeAttentionTritonConfig | TreeAttentionMosaicConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention of n queries over the filled slots of a cache, with its log-sum-exp.

  The cache part of tree attention, public so that other key groups can be merged with
  it (`merge_attention`); hence the LSE is always returned.

  Args:
    q: [batch, n, heads, head_dim].
    cache_k, cache_v: [batch, capacity, kv_heads, head_dim]; heads % kv_heads == 0.
      Slots >= cache_length are ignored.
    cache_length: int32 scalar or [batch], 0 .. capacity (may be traced under jit).
    implementation: "reference" (dense, masked by the length), "xla", "triton", "mosaic"
      or None (see module docstring).
    kernel_config: the kernel's tiling for "triton" or "mosaic" (None: its default).

  Returns:
    out: [batch, n, heads, head_dim] in q's dtype; 0 for an empty cache.
    lse: float32 [batch, n, heads]; -inf for an empty cache.

  Raises:
    ValueError: bad shapes, dtypes or lengths (naming the argument), unknown or
      unsupported implementation.
  """
  _validate_cache_inputs(q, cache_k, cache_v, cache_length)
  implementation = choose(
    "cache_attention",
    implementation,
    _implementations(q, (cache_k, cache_v), kernel_config),
    _DEFAULT_ORDER,
    kernel_config=kernel_config,
  )
  if implementation == "reference":
    return cache_attention_reference(q, cache_k, cache_v, cache_length)
  if implementation in _KERNELS:
    return _kernel(q, cache_k, cache_v, cache_length, implementation=implementation, config=kernel_config)
  return split_cache_attention(q, cache_k, cache_v, cache_length)


@rejects_renamed_arguments
def tree_attention(
  q: jax.Array,
  cache_k: jax.Array,
  cache_v: jax.Array,
  cache_length: jax.Array,
  tree_k: jax.Array,
  tree_v: jax.Array,
  tree_mask: jax.Array,
  *,
  implementation: str | None = None,
  return_lse: bool = False,
  kernel_config: TreeAttentionTritonConfig | TreeAttentionMosaicConfig | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Drafted tree nodes attend to the committed cache and to their own branch.

  Node i's query sees cache slots s < cache_length (no other mask) and the drafted
  nodes j with tree_mask[i, j] (itself and its ancestors); one softmax over all of
  them, scale 1/sqrt(head_dim), float32 math. Inference only (no custom VJP).

  Args:
    q: [batch, n, heads, head_dim], the drafted nodes' queries.
    cache_k, cache_v: [batch, capacity, kv_heads, head_dim], the committed cache;
      heads % kv_heads == 0. Slots >= cache_length are ignored whatever they hold.
    cache_length: int32 scalar or [batch], filled slots, 0 .. capacity (may be traced).
    tree_k, tree_v: [batch, n, kv_heads, head_dim], the drafted nodes' keys and values.
    tree_mask: bool [batch, n, n] or [n, n] (shared by the batch); [i, j] True iff
      node i sees node j (`tree_mask_from_parents`).
    implementation: one of IMPLEMENTATIONS or None (see module docstring).
    return_lse: also return the log-sum-exp, e.g. to merge with more key groups.
    kernel_config: the kernel's tiling for "triton" or "mosaic" (None: its default).

  Returns:
    out [batch, n, heads, head_dim] in q's dtype; with return_lse, (out, lse) with
    lse float32 [batch, n, heads].

  Raises:
    ValueError: bad shapes, dtypes or lengths (naming the argument), unknown or
      unsupported implementation.
  """
  _validate_cache_inputs(q, cache_k, cache_v, cache_length)
  _validate_tree_inputs(q, cache_k, tree_k, tree_v, tree_mask)
  implementation = choose(
    "tree_attention",
    implementation,
    _implementations(q, (cache_k, cache_v, tree_k, tree_v), kernel_config),
    _DEFAULT_ORDER,
    kernel_config=kernel_config,
  )
  if implementation in _KERNELS:
    run = functools.partial(_kernel, implementation=implementation, config=kernel_config)
  else:
    run = tree_attention_reference if implementation == "reference" else hybrid_tree_attention
  out, lse = run(q, cache_k, cache_v, cache_length, tree_k, tree_v, tree_mask)
  return (out, lse) if return_lse else out
