"""Hugging Face checkpoints of the Llama and Qwen2 families as castle_jax transformers.

    model, params, tokenizer = load_hf_model("path/to/Llama-3.2-1B", dtype="bfloat16")
    tokens = generate(model, params, prompt, max_new_tokens=32)

A model directory as `save_pretrained` writes it: `config.json`, the weights in
`model.safetensors` or in shards listed by `model.safetensors.index.json`, and
`tokenizer.json`. Supported: `model_type` "llama" (LlamaForCausalLM: Llama 2, Llama 3,
3.1 and 3.2 with their "llama3" RoPE scaling) and "qwen2" (Qwen2ForCausalLM: Qwen2 and
Qwen2.5, whose query/key/value projections have biases). The checkpoint maps onto a
`TransformerLM` (family "transformer", attention "mha") with the same numerics:

  - RMSNorm: weight times x / sqrt(mean(x^2) + rms_norm_eps), in float32 (ours: `scale`).
  - RoPE: both rotate the two halves of each head (transformers' rotate_half, ours
    `apply_rope`), so the query and key weights are copied without a permutation;
    rope_theta and a "llama3" rope_scaling carry over (`castle_jax.layers.rope.rope_inv_freq`).
  - q/k/v/o, gate/up/down: transformers' [out, in] matrices, transposed into our
    [in, out] kernels (attention kernels reshaped to [d_model, heads, head_dim] and
    [heads, head_dim, d_model]); Qwen2's q/k/v biases into the projections' `bias`.
  - The LM head is the embedding table when tie_word_embeddings (Qwen2.5's small
    models, Llama 3.2), else `lm_head`.

The weights are read with `safetensors` (framework "flax", which reads bfloat16
checkpoints as well) onto one device.

The commands take such a directory as `--workdir` (`castle_jax.workdir.load_trained_model`
tells one from a training workdir with `is_hf_model_dir`, and `run_config` stands in for a
run's config.json), a LongSpec draft trains against one (`load_hf_params` into the
draft's target config), and a run fine-tunes one (`train.init_from`; its model.* values are
`finetune_model_settings`, e.g. through configs/hf_finetune.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from castle_jax.config import COMPUTATION_FIELDS, ModelConfig
from castle_jax.data.tokenizer import PretrainedTokenizer, load_hf_tokenizer
from castle_jax.models.registry import abstract_params, build_model

CONFIG_NAME = "config.json"
TOKENIZER_NAME = "tokenizer.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# model_type -> the architecture `config.json` names for it.
SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE = ("default", "llama3")
# Per-model_type defaults of the config keys a saved config.json may leave out.
_DEFAULTS = {
  "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "tie_word_embeddings": False},
  "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "tie_word_embeddings": False},
}
# model.* keys a run fine-tuning a directory (`train.init_from`) chooses itself: the dtypes
# (the weights are converted) and how the same function of them is computed.
RUN_CHOICES = ("dtype", "param_dtype", *COMPUTATION_FIELDS)
_SUPPORTED_TEXT = ", ".join(f"{kind} ({arch})" for kind, arch in SUPPORTED.items())


class HFModel(NamedTuple):
  """What `load_hf_model` returns (a tuple: `model, params, tokenizer = ...`).

  Attributes:
    model: a `TransformerLM` built from `model.config` (`model_config`'s result).
    params: its parameters, a nested dict of arrays (the "params" collection, unboxed).
    tokenizer: the directory's tokenizer.json, with config.json's bos/eos/pad ids.
  """

  model: nn.Module
  params: dict[str, Any]
  tokenizer: PretrainedTokenizer


def read_hf_config(path: str) -> dict[str, Any]:
  """`path`/config.json as a dict; ValueError when it is missing or not a supported model."""
  config_path = os.path.join(path, CONFIG_NAME)
  if not os.path.isfile(config_path):
    raise ValueError(
      f"{config_path} not found: a Hugging Face model directory needs {CONFIG_NAME}, "
      f"{WEIGHTS_NAME} (or {INDEX_NAME} and its shards) and {TOKENIZER_NAME}"
    )
  with open(config_path) as f:
    config = json.load(f)
  kind = config.get("model_type")
  architectures = config.get("architectures") or []
  if kind not in SUPPORTED or any(arch != SUPPORTED[kind] for arch in architectures):
    raise ValueError(
      f"{config_path}: model_type {kind!r} with architectures {architectures} is not supported; supported: {_SUPPORTED_TEXT}"
    )
  return config


def _rope(config: dict[str, Any], where: str) -> tuple[float, tuple[tuple[str, Any], ...]]:
  """(rope_theta, model.rope_scaling) of an HF config, from `rope_scaling` (transformers 4)
  or `rope_parameters` (transformers 5)."""
  rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
  theta = config.get("rope_theta", rope.get("rope_theta", _DEFAULTS[config["model_type"]]["rope_theta"]))
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind not in SUPPORTED_ROPE:
    raise ValueError(f"{where}: rope_scaling type {kind!r} is not supported; supported: {SUPPORTED_ROPE}")
  if config.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"{where}: partial_rotary_factor {config['partial_rotary_factor']} is not supported (only 1.0)")
  if kind == "default":
    return float(theta), ()
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [key for key in keys if key not in rope]
  if missing:
    raise ValueError(f"{where}: rope_scaling of type 'llama3' lacks {missing}")
  return float(theta), tuple(sorted([("type", "llama3"), *((key, rope[key]) for key in keys)]))


def model_config(
  config: dict[str, Any], *, tie_embeddings: bool | None = None, dtype: str = "float32", param_dtype: str | None = None
) -> ModelConfig:
  """The ModelConfig of an HF config dict (`read_hf_config`).

  tie_embeddings: None reads tie_word_embeddings (its model_type's default when absent).
  dtype: activations; param_dtype: parameters (None: dtype).

  Raises ValueError for a setting this model cannot reproduce (e.g. a sliding window, an
  activation other than SiLU, biases on the output or MLP projections).
  """
  kind = config["model_type"]
  where = f"{CONFIG_NAME} ({kind})"
  unsupported = []
  if config.get("hidden_act", "silu") != "silu":
    unsupported.append(f"hidden_act {config['hidden_act']!r} (only 'silu')")
  if config.get("attention_bias", False):
    unsupported.append("attention_bias (biases on all four attention projections)")
  if config.get("mlp_bias", False):
    unsupported.append("mlp_bias")
  if config.get("use_sliding_window", False):
    unsupported.append("use_sliding_window")
  if unsupported:
    raise ValueError(f"{where}: not supported: {'; '.join(unsupported)}")
  theta, scaling = _rope(config, where)
  n_heads = config["num_attention_heads"]
  if tie_embeddings is None:
    tie_embeddings = config.get("tie_word_embeddings", _DEFAULTS[kind]["tie_word_embeddings"])
  return ModelConfig(
    vocab_size=config["vocab_size"],
    d_model=config["hidden_size"],
    n_layers=config["num_hidden_layers"],
    n_heads=n_heads,
    n_kv_heads=config.get("num_key_value_heads") or n_heads,
    head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
    mlp_hidden=config["intermediate_size"],
    tie_embeddings=bool(tie_embeddings),
    rope_theta=theta,
    rope_scaling=scaling,
    norm_eps=float(config.get("rms_norm_eps", _DEFAULTS[kind]["rms_norm_eps"])),
    qkv_bias=kind == "qwen2",
    dtype=dtype,
    param_dtype=param_dtype or dtype,
  )


def _weight_files(path: str) -> dict[str, str]:
  """{tensor name: safetensors file} of the directory."""
  index_path = os.path.join(path, INDEX_NAME)
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    files = {name: os.path.join(path, file) for name, file in weight_map.items()}
    absent = sorted({file for file in files.values() if not os.path.isfile(file)})
    if absent:
      raise ValueError(f"{index_path} lists shards that are missing: {absent}")
    return files
  single = os.path.join(path, WEIGHTS_NAME)
  if not os.path.isfile(single):
    raise ValueError(
      f"no weights in {path}: expected {WEIGHTS_NAME}, or {INDEX_NAME} and its shards (only safetensors is read)"
    )
  from safetensors import safe_open

  with safe_open(single, framework="flax") as f:
    return {name: single for name in f.keys()}


def _read_tensors(files: dict[str, str]) -> dict[str, Any]:
  from safetensors import safe_open

  tensors = {}
  for file in sorted(set(files.values())):
    with safe_open(file, framework="flax") as f:
      for name in f.keys():
        if files.get(name) == file:
          tensors[name] = f.get_tensor(name)
  return tensors


def _layer_map(config: ModelConfig, layer: int) -> dict[str, tuple[str, Any]]:
  """{HF tensor name: (our "/"-joined path, [out, in] or [n] array -> our layout)} of one block."""
  d, heads, kv_heads, head_dim = config.d_model, config.n_heads, config.kv_heads, config.qk_head_dim
  hf, ours = f"model.layers.{layer}.", f"block_{layer}/"
  in_out = lambda shape: lambda w: w.T.reshape(shape)
  same = lambda w: w
  mapping = {
    "input_layernorm.weight": ("attention_norm/scale", same),
    "post_attention_layernorm.weight": ("mlp_norm/scale", same),
    "self_attn.q_proj.weight": ("attention/query/kernel", in_out((d, heads, head_dim))),
    "self_attn.k_proj.weight": ("attention/key/kernel", in_out((d, kv_heads, head_dim))),
    "self_attn.v_proj.weight": ("attention/value/kernel", in_out((d, kv_heads, head_dim))),
    "self_attn.o_proj.weight": ("attention/out/kernel", in_out((heads, head_dim, d))),
    "mlp.gate_proj.weight": ("mlp/w_gate/kernel", lambda w: w.T),
    "mlp.up_proj.weight": ("mlp/w_up/kernel", lambda w: w.T),
    "mlp.down_proj.weight": ("mlp/w_down/kernel", lambda w: w.T),
  }
  if config.qkv_bias:
    mapping["self_attn.q_proj.bias"] = ("attention/query/bias", lambda b: b.reshape(heads, head_dim))
    mapping["self_attn.k_proj.bias"] = ("attention/key/bias", lambda b: b.reshape(kv_heads, head_dim))
    mapping["self_attn.v_proj.bias"] = ("attention/value/bias", lambda b: b.reshape(kv_heads, head_dim))
  return {hf + name: (ours + path, convert) for name, (path, convert) in mapping.items()}


def convert_params(
  tensors: dict[str, Any], config: ModelConfig, where: str = "the checkpoint", abstract: dict[str, Any] | None = None
) -> dict[str, Any]:
  """Our parameter tree from HF tensors {name: array} (as the safetensors files name
  them), in config.param_dtype; ValueError naming missing, unexpected or misshapen tensors.
  `abstract`: the model's `abstract_params`, when the caller has them (they give the shapes)."""
  mapping = {
    "model.embed_tokens.weight": ("embed/embedding", lambda w: w),
    "model.norm.weight": ("final_norm/scale", lambda w: w),
  }
  if not config.tie_embeddings:
    mapping["lm_head.weight"] = ("lm_head/kernel", lambda w: w.T)
  for layer in range(config.n_layers):
    mapping.update(_layer_map(config, layer))
  # Older checkpoints store RoPE's frequencies, which are recomputed; a tied model may store its head.
  ignored = lambda name: name.endswith("rotary_emb.inv_freq") or (config.tie_embeddings and name == "lm_head.weight")
  missing = sorted(set(mapping) - set(tensors))
  unexpected = sorted(name for name in set(tensors) - set(mapping) if not ignored(name))
  if missing or unexpected:
    raise ValueError(f"{where} does not fit the config: missing tensors {missing}, unexpected tensors {unexpected}")
  if abstract is None:
    abstract = abstract_params(build_model(config), 8)
  expected = traverse_util.flatten_dict(abstract, sep="/")
  params, wrong_shapes = {}, []
  for name, (path, convert) in mapping.items():
    value = convert(jnp.asarray(tensors[name]))
    if value.shape != expected[path].shape:
      wrong_shapes.append(f"{name} -> {path}: {value.shape}, the model needs {expected[path].shape}")
    params[path] = value.astype(config.weights_dtype)
  if wrong_shapes or set(params) != set(expected):
    raise ValueError(
      f"{where} does not fit the config: {wrong_shapes}; parameters not filled: {sorted(set(expected) - set(params))}"
    )
  return traverse_util.unflatten_dict(params, sep="/")


def is_hf_model_dir(path: str) -> bool:
  """Whether `path` holds a Hugging Face model's config.json (one with a `model_type`; a
  training run's config.json has none). Says nothing about whether it is supported."""
  config_path = os.path.join(path, CONFIG_NAME)
  if not os.path.isfile(config_path):
    return False
  try:
    with open(config_path) as f:
      config = json.load(f)
  except (OSError, ValueError):
    return False
  return isinstance(config, dict) and "model_type" in config


def hf_model_config(path: str, dtype: str = "float32", param_dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of the model in directory `path` (read_hf_config, then model_config);
  a config.json without tie_word_embeddings is tied when the weights have no lm_head."""
  path = os.path.abspath(path)
  config = read_hf_config(path)
  tie = config.get("tie_word_embeddings")
  if tie is None:
    tie = "lm_head.weight" not in _weight_files(path)
  return model_config(config, tie_embeddings=tie, dtype=dtype, param_dtype=param_dtype)


def finetune_model_settings(path: str) -> dict[str, Any]:
  """The model.* values a run that fine-tunes the model in directory `path` (`train.init_from`)
  must have: its `hf_model_config`, less the `RUN_CHOICES` the run makes itself."""
  return {key: value for key, value in hf_model_config(path).to_mapping().items() if key not in RUN_CHOICES}


def load_hf_params(
  path: str, config: ModelConfig, mesh: jax.sharding.Mesh | None = None, *, abstract: Any | None = None
) -> dict[str, Any]:
  """The parameters of the model in directory `path`, converted for `config` (its
  `hf_model_config`, perhaps with other dtypes or another family that shares its
  transformer's parameters), in config.param_dtype: on the default device, or sharded over
  `mesh` by their logical axis names (`abstract_params`, as training places them), or into
  the shardings of `abstract` (a tree of ShapeDtypeStructs, e.g. a train state's parameters;
  `mesh` is then unused).

  The tensors are read and converted in host memory, then each parameter goes to its
  devices shard by shard, so a model larger than one accelerator's memory loads onto a
  mesh that holds it.
  """
  path = os.path.abspath(path)
  if abstract is None:
    abstract = abstract_params(build_model(config), 8, mesh=mesh)
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    tensors = _read_tensors(_weight_files(path))
    params = convert_params(tensors, config, where=f"the safetensors weights in {path}", abstract=abstract)
  return jax.device_put(params, jax.tree.map(lambda leaf: leaf.sharding, abstract))


def run_config(path: str) -> dict[str, Any]:
  """What a training run's config.json would say of the model in directory `path`: its
  `model` (float32) and `data` sections, the tokenizer the directory itself. The data
  settings are the repository's defaults (evaluations read the embedded python_stdlib
  corpus's validation split unless told otherwise)."""
  path = os.path.abspath(path)
  return {
    "model": hf_model_config(path).to_mapping(),
    "data": {
      "dataset": "python_stdlib",
      "data_dir": None,
      "source_dir": None,
      "text_key": "text",
      "eval_split": "validation",
      "tokenizer": path,
      "task": "lm",
    },
  }


def load_hf_model(
  path: str,
  dtype: str = "float32",
  param_dtype: str | None = None,
  mesh: jax.sharding.Mesh | None = None,
  *,
  abstract: Any | None = None,
) -> HFModel:
  """(model, params, tokenizer) of a Hugging Face model directory (module docstring).

  Args:
    path: the directory (config.json, safetensors weights, tokenizer.json).
    dtype: the model's activations ("float32", "bfloat16" or "float16").
    param_dtype: the parameters' dtype (None: dtype).
    mesh: shard the parameters over this mesh by their logical axes, never holding the
      whole model on one device (`load_hf_params`); None: the default device.
    abstract: the parameters' ShapeDtypeStructs and shardings, when the caller has them
      (`load_hf_params`; None: derived from the config and `mesh`).

  Raises:
    ValueError: a file is missing, the model_type, rope scaling or another setting is not
      supported (the message names it and what is), or the tensors do not fit the config.
  """
  path = os.path.abspath(path)
  tokenizer = load_hf_tokenizer(path, read_hf_config(path))
  model_cfg = hf_model_config(path, dtype, param_dtype)
  return HFModel(build_model(model_cfg), load_hf_params(path, model_cfg, mesh, abstract=abstract), tokenizer)
