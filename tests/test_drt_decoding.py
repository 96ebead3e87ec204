"""DRT decoding: the streamed logits equal the teacher-forced forward pass however the
tokens are fed, greedy generate() equals the forward pass's argmax, the chunk memory
round-trips through host memory, and the device state does not grow with the context
beyond the landmarks."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.config import ModelConfig
from castle_jax.inference import generate
from castle_jax.models import get_family
from castle_jax.models.drt import DRT, DRTOptions
from castle_jax.models.drt_decoding import HOST_MEMORY_KIND, DRTStream, HostChunkMemory, piece_layout, to_host
from castle_jax.ops.attention import WindowKVCache

# Its tests share a module-scoped model and the forward passes compiled for it: one worker
# runs the whole module under `--dist loadgroup`, so they are built and traced once.
pytestmark = pytest.mark.xdist_group("test_drt_decoding")

CONFIG = ModelConfig(
  family="drt",
  vocab_size=64,
  d_model=32,
  n_layers=4,
  n_heads=4,
  n_kv_heads=2,
  dtype="float32",
  sliding_window=6,
  attention_kwargs=(("positions", "alibi"),),
)


@pytest.fixture(scope="module")
def model_and_params():
  model = DRT(CONFIG, DRTOptions(chunk_size=4, top_k=2, encoder_layers=1, retrieval_groups=2))
  init = jax.jit(lambda tokens: model.init({"params": jax.random.key(1)}, tokens))
  return model, nn.unbox(init(jnp.zeros((2, 8), jnp.int32)))["params"]


def _tokens(seed, length):
  return jax.random.randint(jax.random.key(seed), (2, length), 0, CONFIG.vocab_size)


@functools.lru_cache(maxsize=None)
def _jitted_forward(model):
  return jax.jit(lambda params, tokens: model.apply({"params": params}, tokens)[0])


def _forward(model, params, tokens):
  """The batch (teacher-forced) forward pass's logits [batch, length, vocab], compiled once
  per input shape."""
  return _jitted_forward(model)(params, tokens)


def test_streamed_logits_equal_the_forward_pass(model_and_params):
  """A prompt fed in pieces that start mid-chunk, whole-chunk segments, single tokens
  (ending chunks and not) and a last block: every logit equals the batch forward's."""
  model, params = model_and_params
  tokens = _tokens(0, 41)
  expected = _forward(model, params, tokens)
  stream = DRTStream(model, params, batch=2, capacity=48, segment_chunks=2)
  cuts = [0, 3, 21, 22, 23, 24, 25, 30, 41]
  got = jnp.concatenate([stream.feed(tokens[:, a:b], keep=b - a) for a, b in zip(cuts, cuts[1:])], axis=1)
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
  assert stream.memory.filled == 41 // 4


def test_retrieval_reaches_the_streamed_logits(model_and_params):
  """The served chunks matter: with the host memory's chunks scrambled, logits past the
  first chunks change (so the equality above checks the retrieval path)."""
  model, params = model_and_params
  tokens = _tokens(1, 24)
  stream = DRTStream(model, params, batch=2, capacity=48, segment_chunks=2)
  stream.feed(tokens[:, :16])
  gather = stream.memory.gather
  stream.memory.gather = lambda indices, device: gather((indices + 1) % stream.memory.filled, device)
  scrambled = stream.feed(tokens[:, 16:], keep=8)
  expected = _forward(model, params, tokens)
  assert float(jnp.max(jnp.abs(scrambled - expected[:, 16:]))) > 1e-3


def test_greedy_generate_equals_the_forward_argmax(model_and_params):
  model, params = model_and_params
  prompt = _tokens(2, 6)
  out = generate(model, params, prompt, max_new_tokens=7)
  assert out.shape == (2, 13)
  np.testing.assert_array_equal(out[:, :6], prompt)
  logits = _forward(model, params, out)
  np.testing.assert_array_equal(out[:, 6:], jnp.argmax(logits[:, 5:-1], axis=-1))


def test_family_last_logits_streams(model_and_params):
  model, params = model_and_params
  tokens = _tokens(3, 13)  # the generate test's length: one compiled forward pass for both
  expected = _forward(model, params, tokens)
  got = get_family("drt").last_logits(model, params, tokens, 3)
  np.testing.assert_allclose(got, expected[:, -3:], atol=2e-5, rtol=0)


def test_host_memory_round_trip():
  memory = HostChunkMemory(batch=2, max_chunks=5, chunk_shape=(3, 2, 4), dtype=jnp.bfloat16)
  chunks = jax.random.normal(jax.random.key(0), (2, 5, 3, 2, 4)).astype(jnp.bfloat16)
  memory.write(0, chunks[:, :2], -chunks[:, :2])
  memory.write(2, chunks[:, 2:], -chunks[:, 2:])
  assert memory.nbytes == 2 * chunks.nbytes
  indices = np.array([[[4, 0], [1, 1]], [[2, 3], [0, 4]]])
  keys, values = memory.gather(indices, jax.devices()[0])
  expected = jnp.stack([chunks[b][indices[b]] for b in range(2)])
  np.testing.assert_array_equal(keys, expected)
  np.testing.assert_array_equal(values, -expected)
  assert keys.devices() == {jax.devices()[0]}
  with pytest.raises(ValueError, match="do not follow"):
    memory.write(4, chunks[:, :1], chunks[:, :1])


def test_chunks_are_copied_to_pinned_host_memory():
  x = jnp.ones((2, 3))
  device = jax.devices()[0]
  host = to_host(x)
  if HOST_MEMORY_KIND in [m.kind for m in device.addressable_memories()]:
    assert host.sharding.memory_kind == HOST_MEMORY_KIND
  np.testing.assert_array_equal(np.asarray(host), x)


def test_device_state_grows_only_by_the_landmarks(model_and_params):
  model, params = model_and_params
  small = DRTStream(model, params, batch=2, capacity=400)
  large = DRTStream(model, params, batch=2, capacity=4000)
  landmark_bytes = 2 * (4000 // 4 - 400 // 4) * CONFIG.d_model * 4
  assert large.device_state_bytes - small.device_state_bytes == landmark_bytes
  assert large.memory.nbytes == 0


def test_window_cache_keeps_the_last_positions():
  cache = WindowKVCache.create(1, 4, 1, 1, jnp.float32)
  for start in (0, 3):
    values = jnp.arange(start, start + 3, dtype=jnp.float32).reshape(1, 3, 1, 1)
    cache = cache.append(values, values)
  np.testing.assert_array_equal(cache.key_positions()[0], [4, 5, 2, 3])
  np.testing.assert_array_equal(cache.keys[0, :, 0, 0], [4, 5, 2, 3])
  with pytest.raises(ValueError, match="capacity 4"):
    cache.append(jnp.zeros((1, 5, 1, 1)), jnp.zeros((1, 5, 1, 1)))


def test_piece_layout():
  assert piece_layout(0, 5, 4) == (False,) * 4 + (True, False)
  assert piece_layout(3, 1, 4) == (False, True)
  assert piece_layout(1, 2, 4) == (False, False)


def test_bad_input_is_named(model_and_params):
  model, params = model_and_params
  stream = DRTStream(model, params, batch=2, capacity=10)
  with pytest.raises(ValueError, match="batch=2"):
    stream.feed(np.zeros((3, 4), np.int32))
  with pytest.raises(ValueError, match="keep"):
    stream.feed(np.zeros((2, 4), np.int32), keep=5)
  with pytest.raises(ValueError, match="capacity"):
    stream.feed(np.zeros((2, 11), np.int32))
  with pytest.raises(ValueError, match="DRTStream"):
    model.apply({"params": params}, jnp.zeros((1, 4), jnp.int32), caches=[])
  with pytest.raises(ValueError, match="capacity"):
    generate(model, params, jnp.zeros((1, 4), jnp.int32), max_new_tokens=4, capacity=6)


def test_gca_output_in_the_residual_stream_streams_like_the_forward_pass(model_and_params):
  """gca_output="residual" (the GCA output also added to the residual stream): the
  streamed logits still equal the batch forward's, and differ from the default block's."""
  default, params = model_and_params
  model = DRT(CONFIG, DRTOptions(chunk_size=4, top_k=2, encoder_layers=1, retrieval_groups=2, gca_output="residual"))
  tokens = _tokens(2, 30)
  forward = jax.jit(lambda m, p, t: m.apply({"params": p}, t)[0], static_argnums=0)
  expected = forward(model, params, tokens)
  assert float(jnp.max(jnp.abs(expected - forward(default, params, tokens))[:, 8:])) > 1e-3
  stream = DRTStream(model, params, batch=2, capacity=32, segment_chunks=2)
  cuts = [0, 17, 18, 30]
  got = jnp.concatenate([stream.feed(tokens[:, a:b], keep=b - a) for a, b in zip(cuts, cuts[1:])], axis=1)
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)


def test_random_retriever_streams_like_the_forward_pass(model_and_params):
  """retriever="random" outside training: the streamed logits (whole chunks from chunk 0,
  one chunk retrieving at chunk 9, one more token) equal the batch forward's, which differ
  from the learned retriever's (two groups, k = 2 of up to 9 chunks)."""
  learned, params = model_and_params
  model = learned.clone(options=dataclasses.replace(learned.options, retriever="random"))
  tokens = _tokens(0, 41)  # the shape of the first test: the learned forward is compiled
  expected = _forward(model, params, tokens)
  assert float(jnp.max(jnp.abs(expected - _forward(learned, params, tokens))[:, 12:])) > 1e-3
  stream = DRTStream(model, params, batch=2, capacity=48, segment_chunks=16)
  cuts = [0, 36, 40, 41]
  got = jnp.concatenate([stream.feed(tokens[:, a:b], keep=b - a) for a, b in zip(cuts, cuts[1:])], axis=1)
  np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
