"""One backend-choice pattern for every op (castle_jax.ops.backend): an explicit choice
that cannot run raises naming the argument, the reason and the alternatives; the default
logs what it took and why it skipped the others; unknown names are rejected. Also the
power chunk decided once (op and FLOP count) and the one kernel-config parser."""

import logging

import jax
import jax.numpy as jnp
import pytest

from castle_jax.layers import power as power_layer
from castle_jax.models import ModelConfig
from castle_jax.ops import backend
from castle_jax.ops.attention import causal_attention
from castle_jax.ops.castle import castle_attention, decode_step, init_cache, prefill
from castle_jax.ops.power import append_tokens, init_cache as power_init_cache, power_attention, resolve
from pallas_kernels.castle import CastleDecodeConfig, CastleMosaicConfig, CastleTritonConfig
from pallas_kernels.power import PowerTritonConfig
from helpers import assert_close


def _normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def test_choose_reports_unknown_and_unsupported_choices_and_logs_the_default(caplog):
  calls = []

  def reason(name, why):
    def unsupported():
      calls.append(name)
      return why

    return unsupported

  table = {
    "fast": backend.Implementation(reason("fast", "needs a bigger head dim")),
    "slow": backend.Implementation(reason("slow", None)),
  }
  with pytest.raises(
    ValueError,
    match=r"my_op: my_arg='fast' cannot run: needs a bigger head dim\. "
    r"Alternatives: \['slow'\]",
  ):
    backend.choose("my_op", "fast", table, ("fast", "slow"), argument="my_arg")
  with pytest.raises(ValueError, match=r"my_op: unknown implementation 'fastest'; choose one of \('fast', 'slow'\)"):
    backend.choose("my_op", "fastest", table, ("fast", "slow"))
  calls.clear()
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    assert backend.choose("my_op", None, table, ("fast", "slow")) == "slow"
  assert "my_op: implementation=None -> 'slow' (skipped fast: needs a bigger head dim)" in caplog.text
  assert calls == ["fast", "slow"]  # each reason runs once per call


@pytest.mark.parametrize("op", ["causal_attention", "castle_attention", "power_attention"])
def test_every_op_logs_its_default_choice(op, caplog):
  x = _normal(0, (1, 8, 2, 16))
  run = {
    "causal_attention": lambda: causal_attention(x, x, x),
    "castle_attention": lambda: castle_attention(x, x, x, x, x, x, block_size=4),
    "power_attention": lambda: power_attention(x, x, x, chunk_size=4),
  }[op]
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    run()
  # On CPU the GPU paths are skipped, and the log says why.
  assert f"{op}: implementation=None -> 'xla'" in caplog.text
  assert "(skipped " in caplog.text and "'cpu'" in caplog.text


def test_explicit_choices_that_cannot_run_raise():
  x = _normal(1, (1, 8, 2, 16))
  with pytest.raises(
    ValueError,
    match=r"causal_attention: implementation='cudnn' cannot run: cuDNN attention "
    r"needs a CUDA GPU.*Alternatives",
  ):
    causal_attention(x, x, x, implementation="cudnn")
  with pytest.raises(ValueError, match=r"power_attention: implementation='triton' cannot run: .*p=2 only"):
    power_attention(x, x, x, p=4, chunk_size=64, implementation="triton")


def test_castle_decode_falls_back_with_a_log_and_raises_when_asked(monkeypatch, caplog):
  """Head dim 24: the decoding kernel takes powers of two only."""
  cache = init_cache(1, 8, 2, 24, jnp.float32)
  prompt = [_normal(i, (1, 3, 2, 24)) for i in range(6)]
  _, cache = prefill(cache, *prompt, implementation="xla")
  token = [x[:, :1] for x in prompt]
  with pytest.raises(ValueError, match="decode_step: implementation='triton' cannot run: .*power-of-two head dims"):
    decode_step(cache, *token, implementation="triton")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # where the default would take the kernel
  with caplog.at_level(logging.DEBUG, logger="castle_jax.ops.backend"):
    decode_step(cache, *token)
  assert "decode_step: implementation=None -> 'xla' (skipped triton: the decoding kernel takes" in caplog.text


def test_power_prefill_respects_the_implementation():
  """Like CASTLE's, the power prefill runs the implementation it is given (not always XLA)."""
  q, k, v = (_normal(i, (1, 6, 2, 16)) for i in range(3))
  cache = power_init_cache(1, 2, 16)
  with pytest.raises(ValueError, match="power_attention: implementation='triton' cannot run: .*multiple of 64"):
    append_tokens(cache, q, k, v, chunk_size=4, implementation="triton")
  out, _ = append_tokens(cache, q, k, v, implementation="triton")  # the kernels' chunk (clipped to 6 tokens)
  expected, _ = append_tokens(cache, q, k, v, implementation="reference")
  assert_close(out, expected)


def test_power_flop_count_follows_the_form_that_runs(monkeypatch):
  """On a GPU, p=2 with head dim 32 runs the kernels: the attention form up to 2 D + 1024 =
  2080 tokens, chunks of 1024 beyond; p=4 runs XLA with chunk 128."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  base = dict(vocab_size=64, d_model=128, n_layers=2, n_heads=4, attention="power")
  for p, seq_len, implementation, chunk in (
    (2, 2048, "triton", 2048),
    (2, 4096, "triton", 1024),
    (4, 4096, "xla", 128),
  ):
    config = ModelConfig(**base, attention_kwargs=(("p", p),))
    sizes = dict(seq_len=seq_len, p=p, head_dim=32, value_dim=32, dtype=jnp.bfloat16)
    assert resolve(None, None, **sizes) == (implementation, chunk)
    assert power_layer.training_chunk_size(config, seq_len) == chunk
    pinned = ModelConfig(**base, attention_kwargs=(("chunk_size", chunk), ("p", p)))
    assert power_layer.core_flops_per_token(config, seq_len) == power_layer.core_flops_per_token(pinned, seq_len)
  # The count can tell the chunks apart, and the attention form has no state terms.
  config = ModelConfig(**base, attention_kwargs=(("p", 4),))
  larger = ModelConfig(**base, attention_kwargs=(("chunk_size", 1024), ("p", 4)))
  assert power_layer.core_flops_per_token(config, 4096) < power_layer.core_flops_per_token(larger, 4096)
  attention_form = ModelConfig(**base, attention_kwargs=(("chunk_size", 256), ("p", 2)))
  in_chunk_only = 3 * 4 * 2 * 2 * 32 * (256 + 1) / 2  # 3 x heads x (q.k and w.v) x 2 d x mean keys
  assert power_layer.core_flops_per_token(attention_form, 256) == in_chunk_only
  chunked = ModelConfig(**base, attention_kwargs=(("chunk_size", 128), ("p", 2)))
  assert power_layer.core_flops_per_token(chunked, 256) > in_chunk_only


@pytest.mark.parametrize(
  "attention, implementation, match",
  [
    (
      "castle",
      "cudnn",
      r"^model.attention_impl='cudnn' is not an implementation of attention 'castle'; choose one of "
      r"\('reference', 'xla', 'triton', 'mosaic'\)",
    ),
    (
      "castle",
      "pallas",
      r"^attention 'castle': model.attention_impl='pallas' is now 'triton' or 'mosaic' "
      r"\(None picks the fastest that runs here\)$",
    ),
    ("power", "pallas", r"model.attention_impl='pallas' is now 'triton' \("),
    ("mha", "pallas", r"model.attention_impl='pallas' is gone"),
  ],
)
def test_model_config_checks_the_implementation_against_the_attention(attention, implementation, match):
  base = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2)
  with pytest.raises(ValueError, match=match):
    ModelConfig(**base, attention=attention, attention_impl=implementation)
  assert ModelConfig(**base, attention="mha", attention_impl="cudnn").attention_impl == "cudnn"


@pytest.mark.parametrize(
  "cls, text, expected",
  [
    (
      CastleTritonConfig,
      "block_q=64, block_k=32,bwd_num_stages=2",
      CastleTritonConfig(block_q=64, block_k=32, bwd_num_stages=2),
    ),
    (CastleDecodeConfig, "block_rows=64,splits=none", CastleDecodeConfig(block_rows=64, splits=None)),
    (PowerTritonConfig, "block_t=32,num_stages=2", PowerTritonConfig(block_t=32, num_stages=2)),
    (PowerTritonConfig, "", PowerTritonConfig()),
  ],
)
def test_kernel_configs_parse_from_key_value_strings(cls, text, expected):
  assert cls.from_string(text) == expected


def test_kernel_config_strings_name_the_bad_key():
  with pytest.raises(ValueError, match=r"CastleTritonConfig has no key 'blockq'.*known keys: \['block_q'"):
    CastleTritonConfig.from_string("blockq=64")
  with pytest.raises(ValueError, match=r"'64' is not key=value"):
    PowerTritonConfig.from_string("64")
  with pytest.raises(ValueError, match="model.attention_kwargs.kernel_config: 'block_t=48'.*block_t must be a power"):
    ModelConfig(
      vocab_size=64,
      d_model=32,
      n_layers=1,
      n_heads=2,
      attention="power",
      attention_kwargs=(("kernel_config", "block_t=48"),),
    )


def test_kernel_configs_reach_the_ops(monkeypatch):
  """model.attention_kwargs.kernel_config is parsed once, into the config type of
  model.attention_impl, and passed to the op."""
  from castle_jax.layers import castle as castle_layer

  seen = {}

  def spy(*args, kernel_config=None, implementation=None, **kwargs):
    seen["config"], seen["implementation"] = kernel_config, implementation
    return castle_attention(*args, implementation="xla", **kwargs)

  monkeypatch.setattr(castle_layer, "castle_attention", spy)
  from castle_jax.models import build_model

  base = dict(vocab_size=64, d_model=32, n_layers=1, n_heads=2, dtype="float32", attention="castle")
  config = ModelConfig(**base, attention_impl="triton", attention_kwargs=(("kernel_config", "block_q=16,block_k=16"),))
  build_model(config).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  assert seen == {"config": CastleTritonConfig(block_q=16, block_k=16), "implementation": "triton"}
  mosaic = ModelConfig(**base, attention_impl="mosaic", attention_kwargs=(("kernel_config", "block_q=64"),))
  assert mosaic.options.kernel_config == CastleMosaicConfig()
  # Without model.attention_impl the string's type is unknown: CASTLE has two kernel configs.
  with pytest.raises(
    ValueError,
    match=r"model.attention_kwargs.kernel_config needs model.attention_impl set to one of \('triton', 'mosaic'\)",
  ):
    ModelConfig(**base, attention_kwargs=(("kernel_config", "block_q=16"),))
  with pytest.raises(ValueError, match=r"model.attention_impl='xla' takes none: drop it"):
    ModelConfig(**base, attention_impl="xla", attention_kwargs=(("kernel_config", "block_q=16"),))
  with pytest.raises(ValueError, match=r"CastleMosaicConfig.block_q must be 64"):
    ModelConfig(**base, attention_impl="mosaic", attention_kwargs=(("kernel_config", "block_q=16"),))
