"""The decoder LM: causality, cached decoding, generate(), parameter counts, bad input."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.inference import generate, sample_next_token
from castle_jax.ops.attention import KVCache
from castle_jax.layers.registry import get_attention, registered_attentions
from castle_jax.layers.rope import apply_rope
from castle_jax.models import ModelConfig, TransformerLM, build_model, count_parameters
from helpers import rel_err

VARIANTS = {
  "mha": dict(),
  "gqa_window": dict(n_kv_heads=2, sliding_window=4),
  "untied_mqa": dict(n_kv_heads=1, tie_embeddings=False),
  # Qwen2's q/k/v biases and Llama 3's RoPE scaling, with an original context of 64 so that
  # one frequency is kept, one interpolated and two divided by the factor.
  "gqa_qkv_bias_llama3_rope": dict(
    n_kv_heads=2,
    qkv_bias=True,
    rope_scaling=(
      ("factor", 8.0),
      ("high_freq_factor", 4.0),
      ("low_freq_factor", 1.0),
      ("original_max_position_embeddings", 64),
      ("type", "llama3"),
    ),
  ),
  # Block size 4 makes the 11-token tests span several blocks and a ragged last one.
  "castle": dict(attention="castle", n_heads=2, head_dim=16, attention_kwargs=(("block_size", 4),)),
  "castle_swl": dict(
    attention="castle_swl", n_heads=2, head_dim=16, attention_kwargs=(("block_size", 4), ("lookahead_window", 3))
  ),
  # Chunk sizes 3-5 make the 11-token tests cross chunk boundaries with a ragged last chunk.
  "power": dict(attention="power", attention_kwargs=(("chunk_size", 4),)),
  "power_p4_gqa_tspow": dict(
    attention="power",
    n_kv_heads=2,
    # With the authors' LayerNorm on each head's output: decoding and prefill must apply it too.
    attention_kwargs=(("chunk_size", 3), ("d_tile", 4), ("expansion", "tspow"), ("output_norm", "layernorm"), ("p", 4)),
  ),
}


@functools.lru_cache(maxsize=None)  # one compiled init per variant and test process
def _model(**overrides):
  fields = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, dtype="float32") | overrides
  config = ModelConfig(**fields)
  model = TransformerLM(config)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
  # Push the weights off their tiny init so that logits depend strongly on the context.
  params = jax.tree.map(lambda p: p * 8.0 if p.ndim > 1 else p, params)
  return model, params


@functools.lru_cache(maxsize=None)
def _jitted_apply(model):
  return jax.jit(model.apply)


def _apply(model, params, *args):
  """`model.apply` compiled once per model and input shape: the forward passes of the
  tests below share one 11-token compile per variant."""
  return _jitted_apply(model)({"params": params}, *args)


def _tokens(seed, batch=2, seq=11, vocab=64):
  return jax.random.randint(jax.random.key(seed), (batch, seq), 0, vocab)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_future_tokens_never_change_past_logits(variant):
  model, params = _model(**VARIANTS[variant])
  tokens = _tokens(1)
  logits, _ = _apply(model, params, tokens)
  for t in (0, 5, 9):
    changed = tokens.at[:, t + 1 :].set((tokens[:, t + 1 :] + 17) % 64)
    new_logits, _ = _apply(model, params, changed)
    np.testing.assert_array_equal(new_logits[:, : t + 1], logits[:, : t + 1])
    assert np.abs(new_logits[:, t + 1 :] - logits[:, t + 1 :]).max() > 1e-3  # the test can fail


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_equals_parallel_forward(variant):
  model, params = _model(**VARIANTS[variant])
  tokens = _tokens(2)
  full, _ = _apply(model, params, tokens)
  caches = model.init_cache(batch=2, capacity=16)
  positions = jnp.broadcast_to(jnp.arange(11), tokens.shape)
  # Prefill 5 tokens, then 3 steps of one token, then a chunk of 3.
  pieces = [(0, 5), (5, 6), (6, 7), (7, 8), (8, 11)]
  outs = []
  for start, stop in pieces:
    logits, caches = _apply(model, params, tokens[:, start:stop], positions[:, start:stop], caches)
    outs.append(logits)
  assert rel_err(jnp.concatenate(outs, axis=1), full) < 1e-5
  assert int(caches[0].length) == 11


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generate_matches_parallel_argmax(variant):
  model, params = _model(**VARIANTS[variant])
  prompt = _tokens(3, seq=5)
  out = generate(model, params, prompt, max_new_tokens=6)
  assert out.shape == (2, 11)
  np.testing.assert_array_equal(out[:, :5], prompt)
  logits, _ = _apply(model, params, out)
  np.testing.assert_array_equal(jnp.argmax(logits[:, 4:-1], -1), out[:, 5:])


# Rows of different lengths reach the KV cache (per-row lengths, the window's ring) and the
# positions (RoPE, scaled or not); head grouping and the output embedding are the same code for
# every row. The default suite runs grouped heads with and without a window; the plain and
# single-KV-head models run with -m slow.
KV_CACHE_VARIANTS = [
  "gqa_qkv_bias_llama3_rope",
  "gqa_window",
  pytest.param("mha", marks=pytest.mark.slow),
  pytest.param("untied_mqa", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("variant", KV_CACHE_VARIANTS)
def test_generate_takes_prompts_of_different_lengths(variant):
  """Rows of lengths 2, 5 and 9 (past the window of 4): greedy, each row is its generation
  alone; sampling, each row is that row of a batch repeating its prompt (same key)."""
  model, params = _model(**VARIANTS[variant])
  rows = [np.asarray(_tokens(10 + i, batch=1, seq=n))[0].tolist() for i, n in enumerate((2, 5, 9))]
  out = np.asarray(generate(model, params, rows, max_new_tokens=6))
  assert out.shape == (3, 15)
  for i, row in enumerate(rows):
    alone = np.asarray(generate(model, params, jnp.asarray([row]), max_new_tokens=6))[0]
    np.testing.assert_array_equal(out[i, : len(row) + 6], alone)
    assert (out[i, len(row) + 6 :] == 0).all()
  padded = np.full((3, 12), 63, np.int32)  # the same rows padded past the longest: its columns are dropped
  for i, row in enumerate(rows):
    padded[i, : len(row)] = row
  np.testing.assert_array_equal(generate(model, params, padded, prompt_lengths=[2, 5, 9], max_new_tokens=6), out)
  sample = lambda prompt: np.asarray(
    generate(model, params, prompt, max_new_tokens=6, temperature=1.5, rng=jax.random.key(7))
  )
  sampled = sample(rows)
  for i, row in enumerate(rows):
    repeated = sample(jnp.asarray([row] * 3))
    np.testing.assert_array_equal(sampled[i, : len(row) + 6], repeated[i])


def test_prompts_of_different_lengths_need_kv_caches():
  model, params = _model(**VARIANTS["power"])
  with pytest.raises(ValueError, match=r"different lengths \[2, 3\].*KV caches.*'power'.*once per prompt length"):
    generate(model, params, [[1, 2], [3, 4, 5]], max_new_tokens=2)
  # Equal lengths, as a list or padded, still decode with any cache.
  equal = generate(model, params, [[1, 2], [3, 4]], max_new_tokens=2)
  np.testing.assert_array_equal(
    generate(model, params, jnp.asarray([[1, 2, 0], [3, 4, 0]]), prompt_lengths=[2, 2], max_new_tokens=2), equal
  )
  with pytest.raises(ValueError, match=r"len\(prompt\[0\]\) = 0: every prompt row needs >= 1 token"):
    generate(model, params, [[], [3, 4]], max_new_tokens=2)


def test_sampling_modes():
  model, params = _model()
  prompt = _tokens(4, seq=3)
  greedy = generate(model, params, prompt, max_new_tokens=6)
  top1 = generate(model, params, prompt, max_new_tokens=6, temperature=1.0, top_k=1, rng=jax.random.key(1))
  tiny_p = generate(model, params, prompt, max_new_tokens=6, temperature=1.0, top_p=1e-6, rng=jax.random.key(2))
  np.testing.assert_array_equal(top1, greedy)
  np.testing.assert_array_equal(tiny_p, greedy)
  a = generate(model, params, prompt, max_new_tokens=6, temperature=1.5, rng=jax.random.key(3))
  b = generate(model, params, prompt, max_new_tokens=6, temperature=1.5, rng=jax.random.key(3))
  np.testing.assert_array_equal(a, b)


def test_top_k_and_top_p_restrict_support():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.key(0), 400)
  # One compiled draw over the 400 keys, not 400 eager calls.
  draw = lambda **kw: np.asarray(
    jax.jit(jax.vmap(lambda key: sample_next_token(logits, key, temperature=1.0, **kw)[0]))(keys)
  )
  assert set(draw(top_k=2)) == {0, 1}
  assert set(draw(top_p=0.7)) == {0, 1}  # 0.5 < 0.7 so the second token is needed, the third is not
  assert set(draw()) == {0, 1, 2, 3}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parameter_count_closed_form(variant):
  model, params = _model(**VARIANTS[variant])
  actual = sum(x.size for x in jax.tree.leaves(params))
  assert actual == count_parameters(model.config)


@pytest.mark.parametrize("size, paper", [("s", 160e6), ("m", 353e6), ("l", 756e6), ("xl", 1.310e9)])
def test_paper_baselines_match_table3_parameter_counts(size, paper):
  from train.presets import paper_config

  config = ModelConfig.from_mapping(paper_config(size).model)
  assert abs(count_parameters(config) / paper - 1) < 0.01
  if size == "s":  # the closed form equals what init would create
    model = TransformerLM(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes))) == count_parameters(config)


@pytest.mark.parametrize(
  "size, swl, paper",
  [
    ("s", False, 160e6),
    ("m", False, 351e6),
    ("l", False, 753e6),
    ("xl", False, 1.304e9),
    ("s", True, 160e6),
    ("xl", True, 1.304e9),
  ],
)
def test_paper_castle_models_match_table3_parameter_counts(size, swl, paper):
  from train.presets import castle_paper_config

  config = ModelConfig.from_mapping(castle_paper_config(size, swl=swl).model)
  assert config.attention == ("castle_swl" if swl else "castle")
  assert abs(count_parameters(config) / paper - 1) < 0.01
  if size == "s":  # the closed form equals what init would create
    model = TransformerLM(config)
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    assert sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes))) == count_parameters(config)


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(attention="castle_swl"), "needs model.attention_kwargs.lookahead_window"),
    (dict(attention="castle", attention_kwargs=(("lookahead_window", 4),)), "has no lookahead window"),
    (dict(attention="castle_swl", attention_kwargs=(("lookahead_window", 0),)), "lookahead_window must be an int >= 1"),
    (dict(attention="castle", attention_kwargs=(("block", 4),)), r"Unknown model.attention_kwargs \['block'\]"),
    (dict(attention="castle", n_kv_heads=2), "no grouped-query form"),
    (dict(attention="castle", sliding_window=4), "model.sliding_window"),
  ],
)
def test_bad_castle_options_are_reported(bad, match):
  with pytest.raises(ValueError, match=match):
    _model(**bad)


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(p=3), "model.attention_kwargs.p: p must be an even int >= 2"),
    (dict(p=1), "model.attention_kwargs.p: p must be an even int >= 2"),
    (dict(chunk_size=0), "model.attention_kwargs.chunk_size must be None or an int >= 1"),
    (dict(expansion="sym"), "model.attention_kwargs.expansion must be one of"),
    (dict(expansion="tspow", d_tile=3), r"model.attention_kwargs.d_tile: d_tile \(3\) must divide the head dim \(8\)"),
    (dict(scale=-1.0), "model.attention_kwargs.scale"),
    (dict(gating="yes"), "model.attention_kwargs.gating must be True or False"),
    (dict(gating=False, gate_bias=1.0), "gate_bias has no effect with gating=False"),
    (dict(output_norm="rmsnorm"), r"model.attention_kwargs.output_norm must be one of \(None, 'layernorm'\)"),
    (dict(degree=2), r"Unknown model.attention_kwargs \['degree'\]"),
  ],
)
def test_bad_power_options_are_reported(bad, match):
  with pytest.raises(ValueError, match=match):
    _model(attention="power", attention_kwargs=tuple(sorted(bad.items())))
  with pytest.raises(ValueError, match="model.sliding_window"):
    _model(attention="power", sliding_window=4)


def test_power_parameter_counts():
  ungated = ModelConfig(
    vocab_size=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    attention="power",
    attention_kwargs=(("gating", False),),
  )
  shapes = jax.eval_shape(lambda: TransformerLM(ungated).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  assert sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(shapes))) == count_parameters(ungated)
  # The power-attention paper's small model has GPT-2 small's widths: 124M parameters.
  from train.presets import power_paper_config

  config = ModelConfig.from_mapping(power_paper_config("s").model)
  assert abs(count_parameters(config) / 124e6 - 1) < 0.01
  gated = config.n_layers * config.d_model * config.n_heads  # one gate per head and layer
  baseline = dataclasses.replace(config, attention="mha", attention_kwargs=())
  assert count_parameters(config) - count_parameters(baseline) == gated


@pytest.mark.parametrize("preset", ["icl_config", "icl_gpu_config"])
def test_icl_configs_compare_equal_decoding_states(preset):
  from castle_jax.layers.power import state_size
  from train import presets

  make = getattr(presets, preset)
  power, window, full = (ModelConfig.from_mapping(make(name).model) for name in ("power", "swa", "mha"))
  kv_cache = 2 * window.sliding_window * window.kv_heads * window.qk_head_dim
  assert abs(kv_cache / state_size(power) - 1) < 0.01
  assert full.window is None
  # The arms differ in their attention only.
  shapes = ("d_model", "n_layers", "n_heads", "head_dim", "mlp_hidden", "dtype", "vocab_size")
  assert {tuple(getattr(c, key) for key in shapes) for c in (power, window, full)} == {
    tuple(getattr(power, key) for key in shapes)
  }
  assert make("power").data == make("swa").data == make("mha").data
  assert make("power").train == make("swa").train == make("mha").train


def test_power_output_norm_is_a_layernorm_of_each_head_output():
  """output_norm="layernorm": every head's output is centred and scaled over its head dim by
  one scale and bias shared by the heads, before W_O."""
  from castle_jax.layers.norms import LayerNorm

  model, params = _model(**VARIANTS["power_p4_gqa_tspow"])
  norm = params["block_0"]["attention"]["output_norm"]
  assert norm["scale"].shape == norm["bias"].shape == (model.config.qk_head_dim,)
  assert "output_norm" not in _model(**VARIANTS["power"])[1]["block_0"]["attention"]
  x = jax.random.normal(jax.random.key(1), (2, 3, 4, 8)) * 5.0 + 2.0
  scale, bias = jnp.linspace(0.5, 2.0, 8), jnp.linspace(-1.0, 1.0, 8)
  got = LayerNorm().apply({"params": {"scale": scale, "bias": bias}}, x)
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  np.testing.assert_allclose(got, (x - mean) / np.sqrt(var + 1e-5) * scale + bias, rtol=1e-5, atol=1e-5)


def test_power_cache_size_does_not_depend_on_capacity():
  model, _ = _model(**VARIANTS["power_p4_gqa_tspow"])
  small, large = model.init_cache(batch=2, capacity=16), model.init_cache(batch=2, capacity=1 << 20)
  assert jax.tree.map(lambda x: x.shape, small) == jax.tree.map(lambda x: x.shape, large)
  # kv_heads x D x head_dim with D = C(8/4 + 3, 4) * 4^4 for tspow, p = 4, d_tile = 4.
  assert small[0].state.shape == (2, 2, 5 * 256, 8) and small[0].state.dtype == jnp.float32


def test_unknown_attention_name_is_reported():
  assert "mha" in registered_attentions()
  with pytest.raises(ValueError, match="Unknown attention 'flash'.*registered"):
    get_attention("flash")
  with pytest.raises(ValueError, match="Unknown attention"):
    _model(attention="flash")


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(n_heads=3), "not divisible"),
    (dict(n_kv_heads=3), "multiple of model.n_kv_heads"),
    (dict(d_model=0), "model.d_model must be >= 1"),
    (dict(dtype="float8"), "model.dtype"),
    (dict(head_dim=7, n_heads=2), "even"),
  ],
)
def test_bad_model_config(bad, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4) | bad))


def test_unknown_model_config_key():
  with pytest.raises(ValueError, match="Unknown model config keys.*n_head"):
    ModelConfig.from_mapping(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_head=4))


def test_cache_and_generate_capacity_errors():
  model, params = _model()
  with pytest.raises(ValueError, match="exceeds the cache capacity"):
    generate(model, params, _tokens(5, seq=6), max_new_tokens=5, capacity=8)
  cache = KVCache.create(1, 4, 2, 8, jnp.float32)
  cache = cache.append(jnp.ones((1, 3, 2, 8)), jnp.ones((1, 3, 2, 8)))
  with pytest.raises(ValueError, match="KV cache overflow"):
    cache.append(jnp.ones((1, 2, 2, 8)), jnp.ones((1, 2, 2, 8)))
  with pytest.raises(ValueError, match="temperature"):
    generate(model, params, _tokens(5, seq=2), max_new_tokens=2, temperature=-1.0)
  with pytest.raises(ValueError, match="rng is required"):
    generate(model, params, _tokens(5, seq=2), max_new_tokens=2, temperature=1.0)


def test_mha_tree_verification_leaves_the_cache_and_refuses_what_it_cannot_verify():
  """Tree verification (speculative decoding) returns the nodes' pending keys/values and
  leaves the cache as it was; training and window layers refuse a tree."""
  from castle_jax.layers.mha import MultiHeadAttention, PendingKV, TreeVerification

  config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, dtype="float32")
  layer = MultiHeadAttention(config)
  x = jax.random.normal(jax.random.key(0), (1, 3, 32))
  positions = jnp.array([[2, 3, 3]])
  cache = KVCache.create(1, 4, 4, 8, jnp.float32)
  params = layer.init(jax.random.key(1), x, positions, cache)
  _, cache = layer.apply(params, x[:, :2], jnp.arange(2)[None], cache)
  tree = TreeVerification(jnp.array([[[True, False, False], [True, True, False], [True, False, True]]]))
  out, pending = layer.apply(params, x, positions, cache, tree=tree)
  assert isinstance(pending, PendingKV) and pending.keys.shape == (1, 3, 4, 8) and out.shape == (1, 3, 32)
  # Node 0 sees the cache and itself only: the same as decoding it alone.
  alone, _ = layer.apply(params, x[:, :1], positions[:, :1], cache)
  np.testing.assert_allclose(out[:, 0], alone[:, 0], atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="tree is a decoding argument"):
    layer.apply(params, x, positions, tree=tree)
  window = MultiHeadAttention(dataclasses.replace(config, sliding_window=2))
  with pytest.raises(ValueError, match="full causal attention"):
    window.apply(params, x, positions, cache, tree=tree)


def test_model_families_and_config_defaults():
  from castle_jax.models import MODEL_FAMILIES, build_model, family_of
  from train.config import base_config

  assert set(MODEL_FAMILIES) == {"transformer", "drt", "longspec_draft"}
  with pytest.raises(ValueError, match=r"Unknown model family 'retro' \(config model.family\)"):
    build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, family="retro"))
  model = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2))
  assert isinstance(model, TransformerLM) and family_of(model).name == "transformer"
  # The training config's model block is ModelConfig's defaults, so they cannot drift.
  assert ModelConfig.from_mapping(base_config().model) == ModelConfig()
  model_block = base_config().model
  model_block.init_std = 0.01
  assert ModelConfig.from_mapping(model_block).init_std == 0.01


def test_qkv_bias_option():
  config = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, qkv_bias=True, dtype="float32")
  model = build_model(config)
  params = nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))["params"]
  attention = params["block_0"]["attention"]
  assert attention["query"]["bias"].shape == (4, 8) and attention["key"]["bias"].shape == (2, 8)
  assert sum(x.size for x in jax.tree.leaves(params)) == count_parameters(config)
  plain = build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, dtype="float32"))
  plain_params = plain.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
  assert "bias" not in plain_params["block_0"]["attention"]["query"]
  with pytest.raises(
    ValueError, match=r"qkv_bias is supported for the 'transformer' family \(and a LongSpec draft of one\) with 'mha'"
  ):
    ModelConfig(attention="castle", qkv_bias=True)


def test_rope_scaling_option():
  from train.config import base_config

  x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
  positions = jnp.arange(5)[None]
  np.testing.assert_array_equal(apply_rope(x, positions, 500.0), apply_rope(x, positions, 500.0, ()))
  scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  model_block = base_config().model  # a training config sets it as a dict
  model_block.rope_scaling = {**scaling, "original_max_position_embeddings": 64}
  config = ModelConfig.from_mapping(model_block)
  assert dict(config.rope_scaling)["factor"] == 8.0
  scaled = apply_rope(x, positions, 500.0, config.rope_scaling)
  assert not np.allclose(scaled, apply_rope(x, positions, 500.0))  # the lowest frequencies are slowed down
  np.testing.assert_array_equal(scaled[..., 0], apply_rope(x, positions, 500.0)[..., 0])  # the highest is kept
  with pytest.raises(ValueError, match=r"rope_scaling type 'yarn' is not supported; supported: \('llama3',\)"):
    ModelConfig(rope_scaling=(("type", "yarn"),))
  with pytest.raises(ValueError, match=r"needs exactly the keys"):
    ModelConfig.from_mapping({"rope_scaling": scaling})
