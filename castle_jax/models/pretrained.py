"""Trained models shipped with the package (`castle_jax/assets/`), small enough for a CPU.

    model, params, config = load_pretrained("drt_tiny_retrieval_topk")

An asset `<name>` is two files: `<name>.config.json`, the training run's whole config
(as `python -m train` writes it to the workdir), and `<name>.npz`, the parameters in
float16 (half the size; the model computes in float32, and float16 keeps a trained
model's weights to about 3 significant digits), one array per parameter named by its
"/"-joined Flax path (`block_0/attention/key/kernel`). They are read with
`importlib.resources`, so they load the same from a checkout and from a pip-installed
package (Colab). `python -m castle_jax.models.export_pretrained --workdir=W --name=N` makes
one from a training workdir.

The assets:

  drt_tiny_retrieval_topk: a 1.09M-parameter DRT (d_model 128, 2 lower + 2 upper layers
    of 4 heads, a 1-layer chunk encoder, chunks of 31 tokens + landmark, top-4 retrieval
    in one group, an ALiBi window of 64, byte tokens) that finds a 5-digit passkey by
    retrieval. Trained on one H100 on passkey prompts over the python_stdlib corpus, in
    two stages:

      python -m train --config=configs/drt_tiny_retrieval.py --workdir=runs/drt_tiny_retrieval
      python -m train --config=configs/drt_tiny_retrieval_topk.py --workdir=runs/drt_tiny_retrieval_topk \\
          --config.train.init_from=runs/drt_tiny_retrieval

    The first stage (512-token prompts, every earlier chunk retrieved, ~13.6K steps)
    reached an answer eval loss of 0.080; the second (top-4 retrieval with Gumbel noise
    on 2,047-token prompts, 5,000 steps) 0.0003. `python -m castle_jax.eval.passkey
    --top_k=4` on the second stage: all five digits right in 20 of 20 prompts at 128K
    tokens, 13 of 20 at 1M, 0 of 4 at 4M (retrieval does not hold up past about 1M
    tokens yet).

  variable_tracking_mha_4_heads, variable_tracking_castle_2_heads,
  variable_tracking_castle_swl_2_heads: 4-layer byte-level models (d_model 128, ~0.8M
    parameters) trained on variable tracking with overwrites (4 names, 8 assignments, 4
    queries, 60-token prompts; docs/tasks.md): standard attention with 4 heads of 32, and
    CASTLE and CASTLE-SWL (lookahead window 16) with 2 heads of 32 at parameter parity. Each
    is the best of 8 seeds of 5,000 steps on one H100 (benchmarks/variable_tracking_seeds.sh,
    docs/reproduction.md): query accuracy on 400 fresh prompts 0.566, 0.864 and 0.489
    (chance 0.10). None solved the task; they are there to be scored on variants of it:

      python -m castle_jax.eval.tasks --pretrained=variable_tracking_castle_2_heads \\
          --output=vt.json --config.data.variable_tracking.overwrite_rate=0.9
"""

from __future__ import annotations

import importlib.resources
import json
import pathlib
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util

from castle_jax.models import ModelConfig, build_model
from castle_jax.workdir import abstract_params

CONFIG_SUFFIX = ".config.json"
PARAMS_SUFFIX = ".npz"
_ASSETS = importlib.resources.files("castle_jax").joinpath("assets")


class PretrainedModel(NamedTuple):
  """What `load_pretrained` returns (a tuple: `model, params, config = ...`).

  Attributes:
    model: the Flax module, built from `config.model` as the trainer builds it.
    params: its parameters, a nested dict of float32 arrays (the "params" collection, unboxed).
    config: the training run's config.
  """

  model: nn.Module
  params: dict[str, Any]
  config: ml_collections.ConfigDict


def _assets(directory: str | None):
  return _ASSETS if directory is None else pathlib.Path(directory)


def available_pretrained(directory: str | None = None) -> list[str]:
  """The names of the shipped assets (or of those in `directory`), sorted."""
  return sorted(
    entry.name[: -len(CONFIG_SUFFIX)] for entry in _assets(directory).iterdir() if entry.name.endswith(CONFIG_SUFFIX)
  )


def load_pretrained(name: str = "drt_tiny_retrieval_topk", directory: str | None = None) -> PretrainedModel:
  """(model, params, config) of the shipped asset `name` (see the module docstring), or of
  the asset `name` in `directory` (as `python -m castle_jax.models.export_pretrained` writes one).

  Raises:
    ValueError: `name` is not an asset (the message lists the available ones), or its
      parameters do not have the paths and shapes of the model its config builds.
  """
  assets = _assets(directory)
  available = available_pretrained(directory)
  if name not in available:
    raise ValueError(f"No pretrained model {name!r}; available: {available}")
  config = ml_collections.ConfigDict(json.loads(assets.joinpath(name + CONFIG_SUFFIX).read_text()))
  model = build_model(ModelConfig.from_mapping(config.model))
  expected = traverse_util.flatten_dict(abstract_params(model, config.data.seq_len), sep="/")
  with assets.joinpath(name + PARAMS_SUFFIX).open("rb") as f, np.load(f) as stored:
    arrays = {path: stored[path] for path in stored.files}
  missing, unexpected = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
  wrong_shapes = [
    f"{path} {arrays[path].shape} (model: {expected[path].shape})"
    for path in sorted(set(expected) & set(arrays))
    if arrays[path].shape != expected[path].shape
  ]
  if missing or unexpected or wrong_shapes:
    raise ValueError(
      f"{name}{PARAMS_SUFFIX} does not fit the model of {name}{CONFIG_SUFFIX}: missing "
      f"{missing}, unexpected {unexpected}, other shapes {wrong_shapes}"
    )
  params = {path: jnp.asarray(arrays[path], expected[path].dtype) for path in expected}
  return PretrainedModel(model, traverse_util.unflatten_dict(params, sep="/"), config)
