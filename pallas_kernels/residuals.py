"""The name under which the attention ops tag their backward's residuals, for rematerialization.

Under `jax.checkpoint` (a model's `remat`), a block's backward reruns the block's whole
forward, attention kernels included. The custom-VJP attention ops (CASTLE, power, GCA) tag
what their backward reads beyond the inputs (the output, row log-sum-exps, final states)
with `ATTENTION_RESIDUALS`. The policy `save_attention_residuals()` keeps those O(T d) arrays
from the first forward, so the forward kernel runs once; the rest of the block (projections,
MLP) is still recomputed.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

ATTENTION_RESIDUALS = "attention_residuals"


def keep_for_backward(tree: Any) -> Any:
  """`tree` with every array tagged `ATTENTION_RESIDUALS` (identity outside `jax.checkpoint`)."""
  return jax.tree.map(lambda x: checkpoint_name(x, ATTENTION_RESIDUALS), tree)


def save_attention_residuals():
  """A `jax.checkpoint` policy that saves the tagged attention residuals and nothing else."""
  return jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS)
