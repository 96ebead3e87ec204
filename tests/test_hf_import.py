"""Hugging Face checkpoints (castle_jax.models.hf) against transformers' own outputs.

The fixtures in tests/fixtures/hf/ are tiny random Llama 3 (llama3 rope scaling, sharded
weights), Llama 2 and Qwen2 (q/k/v biases, tied embeddings) models with transformers'
float32 logits and greedy generations, written by scripts/make_hf_fixtures.py.
"""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.inference.generate import generate
from castle_jax.layers.rope import rope_inv_freq
from castle_jax.models.hf import load_hf_model, model_config, read_hf_config

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")
NAMES = ("llama3", "llama2", "qwen2")


def reference(name):
  with np.load(os.path.join(FIXTURES, name, "reference.npz")) as stored:
    return {key: stored[key] for key in stored.files}


def copy_fixture(name, tmp_path):
  target = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), target)
  return target


def edit_config(directory, **changes):
  path = directory / "config.json"
  config = json.loads(path.read_text())
  for key, value in changes.items():
    if value is None:
      config.pop(key, None)
    else:
      config[key] = value
  path.write_text(json.dumps(config))


def assert_logits_match(ours, theirs, rtol=1e-5):
  scale = float(np.abs(theirs).max())
  np.testing.assert_allclose(np.asarray(ours), theirs, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_tokens_equal_transformers(name):
  model, params, tokenizer = load_hf_model(os.path.join(FIXTURES, name))
  ref = reference(name)
  ids = jnp.asarray(ref["input_ids"], jnp.int32)
  logits, _ = model.apply({"params": params}, ids)
  assert_logits_match(logits, ref["logits"])
  new_tokens = ref["generated"].shape[1] - ids.shape[1]
  generated = generate(model, params, ids, max_new_tokens=new_tokens)
  np.testing.assert_array_equal(np.asarray(generated), ref["generated"])
  cfg = model.config
  np.testing.assert_allclose(
    np.asarray(rope_inv_freq(cfg.qk_head_dim, cfg.rope_theta, cfg.rope_scaling)), ref["inv_freq"], rtol=1e-6
  )
  assert tokenizer.vocab_size == cfg.vocab_size == 96
  assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (1, 2, 0)


def test_loading_onto_a_mesh_shards_every_parameter_as_training_does():
  """On 8 (fake) devices, data x fsdp x tensor = 2 x 2 x 2: every parameter arrives with the
  sharding `abstract_params` gives it on that mesh (the query kernel split over its heads),
  holding the same values, and the sharded model gives transformers' logits."""
  import ml_collections

  from castle_jax.models.registry import abstract_params
  from train.mesh import make_mesh

  path = os.path.join(FIXTURES, "qwen2")
  mesh = make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=2, num_devices=-1)))
  model, params, _ = load_hf_model(path, mesh=mesh)
  _, single, _ = load_hf_model(path)
  expected = abstract_params(model, 8, mesh=mesh)
  for leaf, want, value in zip(jax.tree.leaves(params), jax.tree.leaves(expected), jax.tree.leaves(single)):
    assert leaf.sharding == want.sharding
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(value))
  query = params["block_0"]["attention"]["query"]["kernel"]
  assert query.addressable_shards[0].data.shape[1] == query.shape[1] // 2  # heads over "tensor"
  ref = reference("qwen2")
  with jax.set_mesh(mesh):
    logits, _ = jax.jit(model.apply)({"params": params}, jnp.asarray(ref["input_ids"], jnp.int32))
  assert_logits_match(logits, ref["logits"])


def test_configs_map_each_convention():
  llama3 = load_hf_model(os.path.join(FIXTURES, "llama3")).model.config
  assert dict(llama3.rope_scaling) == {
    "type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
  }
  assert (llama3.rope_theta, llama3.tie_embeddings, llama3.qkv_bias, llama3.kv_heads) == (500_000.0, False, False, 2)
  llama2 = load_hf_model(os.path.join(FIXTURES, "llama2")).model.config
  assert (llama2.norm_eps, llama2.rope_scaling, llama2.rope_theta) == (1e-5, (), 10_000.0)
  qwen2 = load_hf_model(os.path.join(FIXTURES, "qwen2")).model.config
  assert (qwen2.qkv_bias, qwen2.tie_embeddings, qwen2.norm_eps, qwen2.rope_theta) == (True, True, 1e-6, 1e6)


def test_tokenizers_round_trip_with_config_specials():
  for name in NAMES:
    tokenizer = load_hf_model(os.path.join(FIXTURES, name)).tokenizer
    text = "the quick brown fox"
    assert tokenizer.decode(tokenizer.encode(text)).replace(" ", "") == text.replace(" ", "")
    assert tokenizer.token_byte_lengths[:3].tolist() == [0, 0, 0]  # the specials
    assert (tokenizer.token_byte_lengths[3:] > 0).all()


def test_transformers4_rope_scaling_format_reads_the_same(tmp_path):
  """Hub configs written by transformers 4 keep rope_theta at the top and the scaling in
  rope_scaling (with "rope_type" or the older "type")."""
  directory = copy_fixture("llama3", tmp_path)
  new = read_hf_config(str(directory))
  scaling = dict(new["rope_parameters"])
  theta = scaling.pop("rope_theta")
  scaling.pop("rope_type")
  edit_config(directory, rope_parameters=None, rope_theta=theta, rope_scaling={"type": "llama3", **scaling})
  assert model_config(read_hf_config(str(directory))) == model_config(new)


def test_bfloat16_checkpoint_loads(tmp_path):
  from safetensors.flax import load_file, save_file

  directory = copy_fixture("qwen2", tmp_path)
  weights = directory / "model.safetensors"
  save_file({k: v.astype(jnp.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
  model, params, _ = load_hf_model(str(directory), dtype="float32")
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
  ref = reference("qwen2")
  logits, _ = model.apply({"params": params}, jnp.asarray(ref["input_ids"], jnp.int32))
  assert_logits_match(logits, ref["logits"], rtol=0.05)  # the weights were rounded to bfloat16
  model, params, _ = load_hf_model(str(directory), dtype="bfloat16")
  assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))


def test_missing_config(tmp_path):
  with pytest.raises(ValueError, match=r"config.json not found.*model.safetensors.*tokenizer.json"):
    load_hf_model(str(tmp_path))


def test_unsupported_model_type(tmp_path):
  directory = copy_fixture("llama2", tmp_path)
  edit_config(directory, model_type="mistral", architectures=["MistralForCausalLM"])
  with pytest.raises(
    ValueError, match=r"model_type 'mistral'.*not supported; supported: llama \(LlamaForCausalLM\), qwen2"
  ):
    load_hf_model(str(directory))


def test_unsupported_rope_scaling(tmp_path):
  directory = copy_fixture("llama3", tmp_path)
  edit_config(directory, rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0})
  with pytest.raises(
    ValueError, match=r"rope_scaling type 'yarn' is not supported; supported: \('default', 'llama3'\)"
  ):
    load_hf_model(str(directory))


def test_unsupported_settings(tmp_path):
  directory = copy_fixture("llama2", tmp_path)
  edit_config(directory, hidden_act="gelu", attention_bias=True)
  with pytest.raises(ValueError, match=r"not supported: hidden_act 'gelu'.*; attention_bias"):
    load_hf_model(str(directory))


def test_missing_weights(tmp_path):
  directory = copy_fixture("llama2", tmp_path)
  os.remove(directory / "model.safetensors")
  with pytest.raises(ValueError, match=r"no weights in .*model.safetensors, or model.safetensors.index.json"):
    load_hf_model(str(directory))
  directory = copy_fixture("llama3", tmp_path)
  os.remove(directory / "model-00002-of-00007.safetensors")
  with pytest.raises(ValueError, match=r"lists shards that are missing: .*model-00002-of-00007.safetensors"):
    load_hf_model(str(directory))


def test_missing_tokenizer(tmp_path):
  directory = copy_fixture("qwen2", tmp_path)
  os.remove(directory / "tokenizer.json")
  with pytest.raises(ValueError, match=r"tokenizer.json not found"):
    load_hf_model(str(directory))


def test_tensors_that_do_not_fit(tmp_path):
  from safetensors.flax import load_file, save_file

  directory = copy_fixture("qwen2", tmp_path)
  weights = directory / "model.safetensors"
  tensors = load_file(str(weights))
  del tensors["model.layers.1.self_attn.k_proj.bias"]
  tensors["model.layers.1.extra.weight"] = jnp.zeros(3)
  save_file(tensors, str(weights))
  with pytest.raises(
    ValueError,
    match=r"missing tensors \['model.layers.1.self_attn.k_proj.bias'\], unexpected tensors \['model.layers.1.extra.weight'\]",
  ):
    load_hf_model(str(directory))
