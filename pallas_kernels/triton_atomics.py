"""Relaxed atomic adds for Pallas Triton kernels.

`jax.experimental.pallas.triton.atomic_add` lowers to acquire-release atomics at GPU
scope: every element is a fenced read-modify-write. Kernels that only accumulate
partial sums (and read them after the kernel ends) need no ordering at all, and the
fences cost far more than the additions. `relaxed_atomic_add` is the same operation
with relaxed memory semantics; Pallas has no public switch for it, so this module
defines a primitive whose abstract evaluation, interpret-mode discharge and Triton
lowering reuse Pallas' own atomic machinery (private modules of the pinned jax
0.11.2), changing only the memory semantics. Tests exercise the discharge rule on
CPU and the lowering on the GPU.
"""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src import state
from jax._src import tree_util
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import primitives as triton_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing
from jax._src.state import primitives as state_primitives

_ADD = triton_primitives.AtomicOpType.ADD

relaxed_atomic_add_p = jax_core.Primitive("relaxed_atomic_add")


@relaxed_atomic_add_p.def_effectful_abstract_eval
def _abstract_eval(*avals_flat, args_tree):
  return triton_primitives._atomic_abstract_eval(*avals_flat, args_tree=args_tree, atomic_type=_ADD)


@state_discharge.register_discharge_rule(relaxed_atomic_add_p)
def _discharge(ctx, *args_flat, args_tree):
  return triton_primitives._atomic_rmw_discharge_rule(ctx, *args_flat, args_tree=args_tree, atomic_type=_ADD)


@triton_lowering.register_lowering(relaxed_atomic_add_p)
def _lowering(ctx: triton_lowering.LoweringRuleContext, *args_flat, args_tree):
  block_info, *_ = ctx.block_infos
  ptr, indexers, val, _ = args_tree.unflatten(args_flat)
  *_, value_aval, _ = args_tree.unflatten(ctx.avals_in)
  indexers = list(indexers)
  if not indexers or not isinstance(indexers[-1], indexing.NDIndexer):
    ref_aval = state.transform_type(indexers, ctx.avals_in[0])
    indexers.append(indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
  if len(indexers) != 1:
    raise NotImplementedError("relaxed_atomic_add supports a single indexer")
  ptr = triton_lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
  val = triton_lowering._ensure_ir_value(val, value_aval)
  return triton_lowering._atomic_rmw(tt_dialect.RMWOp.FADD, ptr, val, semantic=tt_dialect.MemSemantic.RELAXED)


def relaxed_atomic_add(ref, idx, val) -> None:
  """ref[idx] += val with relaxed atomics (float32 refs; no ordering with other memory ops).

  Args:
    ref: a Pallas Triton ref (kernel argument or view).
    idx: an index into it (slices / pl.ds).
    val: the values to add, of the indexed shape.
  """
  ref, transforms = state_primitives.get_ref_and_transforms(ref, idx, "relaxed_atomic_add")
  args_flat, args_tree = tree_util.tree_flatten((ref, transforms, val, None))
  relaxed_atomic_add_p.bind(*args_flat, args_tree=args_tree)
