"""Grouped cross attention (GCA): the one public entry point.

`implementation`:
  - "reference": every retrieved chunk's scores materialized at once (plain jnp,
    autodiff); a test oracle.
  - "xla": one retrieved chunk at a time with a custom VJP that keeps only per-chunk
    log-normalizers (`xla.py`); memory O(T (d + k)) for the backward.
  - "triton": the fused Pallas Triton kernels of `pallas_kernels.gca` (each program gathers
    its retrieved chunks' K/V by index, softmax_1 and the weighted sum in registers; a
    deterministic backward): power-of-two head dims in [16, 256], memory chunks of at
    most 256 keys, float32/bfloat16/float16 queries; `kernel_config` a `GcaTritonConfig`.
  - "mosaic": the same on Pallas Mosaic GPU, Hopper only: bfloat16/float16, head dim 64
    or 128, memory chunks of at most 64 keys; `kernel_config` a `GcaMosaicConfig`.
  The kernels compile on a CUDA GPU and run in Pallas interpret mode elsewhere (slow; for
  tests).
  - None: the fastest that can run here (`castle_jax.ops.backend.choose`, logged):
    "mosaic" on a Hopper GPU where it takes the inputs (measured faster, forward and
    backward: benchmarks/RESULTS.md), else "triton" on a GPU, else "xla".

No decoding kernel: DRT's token-by-token step calls this op with its few query rows
placed on the query-chunk grid and picks the same way.
"""

from __future__ import annotations

import jax

from castle_jax.ops.backend import Implementation, choose, rejects_renamed_arguments
from castle_jax.ops.gca.xla import gca_chunked
from castle_jax.ops.gca.common import validate_inputs
from castle_jax.ops.gca.reference import gca_reference
from castle_jax.sharding import SEQUENCE_HEADS_AXES, map_over_shards
from pallas_kernels.gca import GcaMosaicConfig, GcaTritonConfig, gca_attention_mosaic, gca_attention_triton
from pallas_kernels.gca import mosaic, triton as triton_ops

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic")
DEFAULT_ORDER = ("mosaic", "triton", "xla")
# The kernel config type of each kernel implementation (`kernel_config=`).
KERNEL_CONFIGS = {"triton": GcaTritonConfig, "mosaic": GcaMosaicConfig}
_MEMORY_AXES = ("batch", None, None, "act_kv_heads", None)  # [batch, chunks, chunk_len, kv_heads, head_dim]
_SLOT_AXES = ("batch", None, None)  # [batch, query_chunks, k]


def _interpret() -> bool:
  return jax.default_backend() == "cpu"


def implementations(
  q: jax.Array, chunk_k: jax.Array, kernel_config=None, query_chunks: int | None = None, top_k: int | None = None
) -> dict[str, Implementation]:
  """The GCA implementations for these (validated) inputs; `query_chunks` and `top_k`
  (chunk_indices' last two axes) let the kernels' shared-memory checks count a query chunk's
  rows and its slots (without them: one 64-row tile and one slot for the Mosaic kernels, the
  longest tiles for the Triton ones). `kernel_config` is checked by the implementation it
  configures."""
  query_len = None if query_chunks is None else q.shape[1] // query_chunks
  sizes = dict(head_dim=q.shape[-1], chunk_len=chunk_k.shape[2], heads=q.shape[2], kv_heads=chunk_k.shape[3])

  def config_of(config_type):
    return kernel_config if isinstance(kernel_config, config_type) else None

  def triton_unsupported() -> str | None:
    return triton_ops.unsupported_reason(**sizes, dtype=q.dtype, config=config_of(GcaTritonConfig), query_len=query_len)

  def mosaic_unsupported() -> str | None:
    return mosaic.unsupported_reason(
      config_of(GcaMosaicConfig),
      **sizes,
      dtype=q.dtype,
      query_len=query_len or 1,
      top_k=top_k or 1,
      interpret=_interpret(),
    )

  return {
    "reference": Implementation(),
    "xla": Implementation(),
    "triton": Implementation(triton_unsupported, default_backends=("gpu",), config_type=GcaTritonConfig),
    "mosaic": Implementation(mosaic_unsupported, default_backends=("gpu",), config_type=GcaMosaicConfig),
  }


@rejects_renamed_arguments
def gca_attention(
  q: jax.Array,
  chunk_k: jax.Array,
  chunk_v: jax.Array,
  chunk_weights: jax.Array,
  chunk_indices: jax.Array,
  *,
  scale: float | None = None,
  implementation: str | None = None,
  kernel_config: GcaTritonConfig | GcaMosaicConfig | None = None,
) -> jax.Array:
  """Each query chunk attends to its k retrieved memory chunks, separately, and mixes them.

  out[b, c*L + i, h] = sum_j chunk_weights[b, c, j] * softmax_1(q[b, c*L + i, h] .
      chunk_k[b, idx, :, h // group]^T * scale) chunk_v[b, idx, :, h // group],
  idx = chunk_indices[b, c, j], L = seq // query_chunks, group = heads // kv_heads,
  softmax_1(z)_s = exp(z_s) / (1 + sum_s' exp(z_s')).

  Args:
    q: [batch, seq, heads, head_dim]; seq = query_chunks * L, token c*L + i is row i of
      query chunk c.
    chunk_k, chunk_v: [batch, memory_chunks, chunk_len, kv_heads, head_dim], the memory
      chunks' keys and values (heads % kv_heads == 0).
    chunk_weights: float [batch, query_chunks, k], the weight of each retrieved chunk
      (e.g. `select_chunks`' softmax of the retrieval scores; 0 for an empty slot).
      Differentiable: the retriever learns through it.
    chunk_indices: int [batch, query_chunks, k] in [0, memory_chunks), which memory
      chunk each slot holds (out-of-range indices are clipped). No gradient.
    scale: score scale, default 1/sqrt(head_dim).
    implementation: one of IMPLEMENTATIONS or None (see module docstring).
    kernel_config: a `GcaTritonConfig` for "triton", a `GcaMosaicConfig` for "mosaic",
      or None for their defaults. With implementation=None only the implementation it
      configures (or "xla") can be chosen.

  Returns:
    [batch, seq, heads, head_dim] in q's dtype ("reference"/"xla" compute bf16 inputs in
    float32; the kernels run bf16 products with float32 accumulation).

  Raises:
    ValueError: bad shapes or dtypes (naming the argument), seq not a multiple of the
      query chunks, k < 1, unknown implementation or an explicit one that cannot run.
  """
  validate_inputs(q, chunk_k, chunk_v, chunk_weights, chunk_indices)
  table = implementations(q, chunk_k, kernel_config, *chunk_indices.shape[1:])
  implementation = choose("gca_attention", implementation, table, DEFAULT_ORDER, kernel_config=kernel_config)
  if implementation in KERNEL_CONFIGS:
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)

    def run(q, chunk_k, chunk_v, chunk_weights, chunk_indices):
      arrays = (q, chunk_k, chunk_v, chunk_weights, chunk_indices)
      if implementation == "triton":
        return gca_attention_triton(*arrays, scale=scale, config=kernel_config, interpret=_interpret())
      stages = (kernel_config or GcaMosaicConfig()).stages
      return gca_attention_mosaic(*arrays, scale=scale, stages=stages, interpret=_interpret())

    return map_over_shards(
      run,
      (q, chunk_k, chunk_v, chunk_weights, chunk_indices),
      [SEQUENCE_HEADS_AXES, _MEMORY_AXES, _MEMORY_AXES, _SLOT_AXES, _SLOT_AXES],
      SEQUENCE_HEADS_AXES,
      what="gca_attention",
    )
  run = gca_reference if implementation == "reference" else gca_chunked
  return run(q, chunk_k, chunk_v, chunk_weights, chunk_indices, scale=scale)
