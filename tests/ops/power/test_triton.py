"""Power attention Pallas kernels in interpret mode (CPU): the same kernel code the GPU compiles.

Compared with the attention form from the definition: outputs, final states and the
gradients of q, k, v, the log-gates and the initial state, with grouped-query heads,
gating on and off, a length that is no multiple of the chunk, length 1, states handed
in and out in another expansion's layout, bf16 inputs, and bad input.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.ops.power import PowerState, expand, expanded_dim, power_attention
from helpers import lowered_for_h100, rel_err
from pallas_kernels.power import PowerTritonConfig, triton_discumsum, triton_kernels, power_attention_triton

B, HQ, HKV, D_HEAD, D_VALUE = 2, 4, 2, 32, 16
SMALL = PowerTritonConfig(block_t=16, block_q=16, block_k=16, grad_block=16)


pytestmark = pytest.mark.usefixtures("full_float32_matmuls")


def _inputs(seed, seq, dtype=jnp.float32, gating=True):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, seq, HQ, D_HEAD)), dtype)
  k = jnp.asarray(rng.standard_normal((B, seq, HKV, D_HEAD)), dtype)
  v = jnp.asarray(rng.standard_normal((B, seq, HKV, D_VALUE)), dtype)
  log_g = jnp.asarray(-np.logaddexp(0.0, -(2.0 + rng.standard_normal((B, seq, HKV)))), jnp.float32)
  return q, k, v, (log_g if gating else None)


def _state(seed, expansion="spow", d_tile=None):
  rng = np.random.default_rng(seed)
  dim = expanded_dim(D_HEAD, 2, expansion, d_tile)
  # A state some real tokens could have left: sums of phi(k) v^T, so the normalizer is positive.
  keys = jnp.asarray(rng.standard_normal((B, HKV, 5, D_HEAD)), jnp.float32)
  values = jnp.asarray(rng.standard_normal((B, HKV, 5, D_VALUE)), jnp.float32)
  phi = expand(keys * D_HEAD**-0.25, 2, expansion, d_tile)
  assert phi.shape[-1] == dim
  return PowerState(jnp.einsum("bhtD,bhte->bhDe", phi, values), jnp.sum(phi, axis=2))


def test_tile_pairs_give_the_tspow_layout():
  assert triton_kernels.expanded_dim(64) == expanded_dim(64, 2, "tspow", 16) == 2560
  assert [(s, t) for s, t, _ in triton_kernels.tile_pairs(48)] == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("gating", [True, False])
def test_outputs_and_final_state_match_the_definition(gating):
  inputs = _inputs(0, seq=40, gating=gating)
  out, (state, normalizer) = jax.jit(
    functools.partial(power_attention_triton, scale=D_HEAD**-0.5, chunk_size=16, config=SMALL)
  )(*inputs)
  expected, expected_state = jax.jit(
    functools.partial(
      power_attention, implementation="reference", expansion="tspow", d_tile=16, return_final_state=True
    )
  )(*inputs)
  assert rel_err(out, expected) < 1e-5
  assert rel_err(state, expected_state.state) < 1e-5
  assert rel_err(normalizer, expected_state.normalizer) < 1e-5
  # The check can fail: dropping the gates or the cross-chunk state changes the outputs.
  other = power_attention(*_inputs(0, seq=40, gating=not gating), implementation="reference")
  assert rel_err(other, expected) > 1e-2
  one_chunk_each = jnp.concatenate(
    [
      power_attention(*(None if x is None else x[:, s : s + 16] for x in inputs), implementation="reference")
      for s in range(0, 40, 16)
    ],
    axis=1,
  )
  assert rel_err(one_chunk_each, expected) > 1e-2


def test_entry_point_with_states_in_another_layout_and_length_one():
  inputs = _inputs(1, seq=70)
  initial = _state(2)
  run = functools.partial(power_attention, chunk_size=64, initial_state=initial, return_final_state=True)
  out, state = jax.jit(functools.partial(run, implementation="triton"))(*inputs)
  expected, expected_state = jax.jit(functools.partial(run, implementation="reference"))(*inputs)
  assert state.state.shape == initial.state.shape  # spow layout out, as in
  assert rel_err(out, expected) < 1e-5
  assert rel_err(state.state, expected_state.state) < 1e-5
  assert rel_err(state.normalizer, expected_state.normalizer) < 1e-5
  single = tuple(x[:, :1] for x in inputs)
  assert (
    rel_err(power_attention(*single, implementation="triton"), power_attention(*single, implementation="reference"))
    < 1e-5
  )


@pytest.fixture(params=["unrolled", "looped"])
def tile_pair_loop(request, monkeypatch):
  """Runs a test with the tile pairs unrolled (as for head dims <= 64) and as a loop over the
  row blocks (as for larger heads), at the tests' head dim."""
  if request.param == "looped":
    monkeypatch.setattr(triton_kernels, "MAX_UNROLLED_PAIRS", 0)
  assert triton_kernels.unrolls_tile_pairs(D_HEAD) == (request.param == "unrolled")
  return request.param


def test_head_dims_up_to_64_unroll_the_tile_pairs():
  assert [triton_kernels.unrolls_tile_pairs(d) for d in (16, 32, 64, 128)] == [True, True, True, False]


@pytest.mark.usefixtures("tile_pair_loop")
def test_gradients_match_the_definition():
  inputs = _inputs(3, seq=40)
  initial = _state(4, expansion="tspow", d_tile=16)
  cotangent = jnp.asarray(np.random.default_rng(5).standard_normal((B, 40, HQ, D_VALUE)), jnp.float32)
  state_cotangent = jax.tree.map(
    lambda x: jnp.asarray(np.random.default_rng(6).standard_normal(x.shape), jnp.float32), initial
  )

  def loss(fn, q, k, v, log_g, state, normalizer):
    out, (final_state, final_normalizer) = fn(q, k, v, log_g, PowerState(state, normalizer))
    return (
      jnp.sum(out * cotangent)
      + jnp.sum(final_state * state_cotangent.state)
      + jnp.sum(final_normalizer * state_cotangent.normalizer)
    )

  ours = lambda q, k, v, g, s: power_attention_triton(
    q, k, v, g, scale=D_HEAD**-0.5, chunk_size=16, initial_state=s, config=SMALL
  )
  reference = lambda q, k, v, g, s: power_attention(
    q, k, v, g, implementation="reference", expansion="tspow", d_tile=16, initial_state=s, return_final_state=True
  )
  args = inputs + tuple(initial)
  grads = jax.jit(jax.grad(functools.partial(loss, ours), argnums=range(6)))(*args)
  expected = jax.jit(jax.grad(functools.partial(loss, reference), argnums=range(6)))(*args)
  for name, g, e in zip(("q", "k", "v", "log_g", "state", "normalizer"), grads, expected):
    assert rel_err(g, e) < 1e-4, name


def test_discumsum_kernels_match_a_scan_and_its_gradient():
  # 3 chunks (not a power of two), rows 48 (slabs of 16, three per head).
  rng = np.random.default_rng(14)
  deltas, d_entering = (jnp.asarray(rng.standard_normal((2, 3, 48, 16)), jnp.float32) for _ in range(2))
  initial, d_final = (jnp.asarray(rng.standard_normal((2, 48, 16)), jnp.float32) for _ in range(2))
  totals = jnp.asarray(-rng.uniform(0.0, 2.0, (2, 3)), jnp.float32)

  def scan(deltas, totals, initial):
    def step(state, chunk):
      delta, total = chunk
      return jnp.exp(total)[:, None, None] * state + delta, state

    final, entering = jax.lax.scan(step, initial, (jnp.moveaxis(deltas, 1, 0), jnp.moveaxis(totals, 1, 0)))
    return jnp.moveaxis(entering, 0, 1), final

  entering, final = triton_discumsum.discumsum(deltas, totals, initial, interpret=True)
  expected_entering, expected_final = scan(deltas, totals, initial)
  assert rel_err(entering, expected_entering) < 1e-6 and rel_err(final, expected_final) < 1e-6
  assert rel_err(entering[:, 1:], deltas[:, :-1]) > 1e-1  # the check can fail: decay and carry matter

  _, pullback = jax.vjp(scan, deltas, totals, initial)
  expected_grads = pullback((d_entering, d_final))
  grads = triton_discumsum.reverse_discumsum(d_entering, totals, entering, d_final, interpret=True)
  for name, g, e in zip(("deltas", "totals", "initial"), grads, expected_grads):
    assert rel_err(g, e) < 1e-5, name


def test_one_chunk_without_states_runs_the_attention_form_alone(monkeypatch):
  inputs = _inputs(15, seq=40)
  cotangent = jnp.asarray(np.random.default_rng(16).standard_normal((B, 40, HQ, D_VALUE)), jnp.float32)
  state_kernel_calls = []
  update_state = triton_kernels.update_state
  monkeypatch.setattr(
    triton_kernels, "update_state", lambda *a, **kw: state_kernel_calls.append(1) or update_state(*a, **kw)
  )

  def loss(impl, *args):
    return jnp.sum(power_attention(*args, chunk_size=64, implementation=impl) * cotangent)

  out = jax.jit(functools.partial(power_attention, chunk_size=64, implementation="triton"))(*inputs)
  grads = jax.jit(jax.grad(functools.partial(loss, "triton"), argnums=range(4)))(*inputs)
  assert not state_kernel_calls
  assert rel_err(out, jax.jit(functools.partial(power_attention, implementation="reference"))(*inputs)) < 1e-5
  expected = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums=range(4)))(*inputs)
  for name, g, e in zip(("q", "k", "v", "log_g"), grads, expected):
    assert rel_err(g, e) < 1e-4, name
  # Asking for the final state (or a longer sequence) takes the chunked path again (the
  # kernels are chosen while tracing: nothing needs to run).
  jax.eval_shape(
    functools.partial(power_attention, chunk_size=64, implementation="triton", return_final_state=True), *inputs
  )
  assert state_kernel_calls


def test_bf16_outputs():
  inputs = _inputs(7, seq=64, dtype=jnp.bfloat16)
  out = power_attention(*inputs, chunk_size=64, implementation="triton")
  expected = power_attention(*(x.astype(jnp.float32) for x in inputs), implementation="reference")
  assert out.dtype == jnp.bfloat16
  assert rel_err(out, expected) < 1e-2


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(p=4), "p=2 only"),
    (dict(chunk_size=100), "multiple of 64"),
  ],
)
def test_bad_options(change, match):
  options = dict(chunk_size=64, implementation="triton") | change
  with pytest.raises(ValueError, match=match):
    power_attention(*_inputs(8, seq=8), **options)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    (dict(block_t=48), "block_t must be a power of two"),
    (dict(grad_block=8), "grad_block must be >= 16"),
    (dict(num_stages=0), "num_stages must be an int >= 1"),
    (dict(row_group=32), "row_group must be <= 16"),
    (dict(block_q=True), "block_q must be an int >= 1"),
  ],
)
def test_bad_kernel_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    PowerTritonConfig(**kwargs)
  PowerTritonConfig(num_stages=5)  # stages need not be a power of two


def test_bad_head_dims():
  q, k, v, log_g = _inputs(9, seq=8)
  with pytest.raises(ValueError, match="power-of-two head_dim"):
    power_attention(q[..., :24], k[..., :24], v, log_g, chunk_size=64, implementation="triton")
  with pytest.raises(ValueError, match="power-of-two value_dim"):
    power_attention(q, k, v[..., :12], log_g, chunk_size=64, implementation="triton")


def test_gradients_through_the_entry_point_with_the_default_config():
  inputs = _inputs(10, seq=70)
  cotangent = jnp.asarray(np.random.default_rng(11).standard_normal((B, 70, HQ, D_VALUE)), jnp.float32)

  def loss(impl, *args):
    return jnp.sum(power_attention(*args, chunk_size=64, implementation=impl) * cotangent)

  grads = jax.jit(jax.grad(functools.partial(loss, "triton"), argnums=range(4)))(*inputs)
  expected = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums=range(4)))(*inputs)
  for name, g, e in zip(("q", "k", "v", "log_g"), grads, expected):
    assert rel_err(g, e) < 1e-4, name


def test_default_implementation_on_a_gpu_picks_the_kernels_when_they_apply(monkeypatch):
  from castle_jax.ops.power import resolve

  sizes = dict(seq_len=4096, p=2, head_dim=D_HEAD, value_dim=D_VALUE, dtype=jnp.float32)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert resolve(None, 128, **sizes) == ("triton", 128)
  assert resolve(None, None, **sizes) == ("triton", 1024)  # the kernels' own chunk
  assert resolve(None, 128, **(sizes | dict(p=4))) == ("xla", 128)
  assert resolve(None, None, **(sizes | dict(p=4))) == ("xla", 128)  # the XLA path's own chunk
  assert resolve(None, 100, **sizes) == ("xla", 100)
  assert resolve(None, 128, **(sizes | dict(head_dim=24))) == ("xla", 128)
  with pytest.raises(ValueError, match="implementation='triton' cannot run: .*p=2 only.*Alternatives"):
    resolve("triton", 128, **(sizes | dict(p=4)))
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert resolve(None, 128, **sizes) == ("xla", 128)


@pytest.mark.parametrize("head_dim, expanded", [(16, 136), (64, 2080), (128, 8256)])  # D = C(d + 1, 2)
def test_default_triton_chunk_is_the_attention_form_while_it_costs_fewer_flops(head_dim, expanded):
  from castle_jax.ops.power import resolve

  def chunk(seq_len, chunk_size=None, implementation="triton"):
    sizes = dict(p=2, head_dim=head_dim, value_dim=head_dim, dtype=jnp.bfloat16)
    return resolve(implementation, chunk_size, seq_len=seq_len, **sizes)[1]

  longest_attention_form = 2 * expanded + 1024
  # One chunk of the whole sequence, rounded up to the kernels' 64-token blocks.
  assert chunk(1) == 64
  assert chunk(1000) == 1024
  assert chunk(longest_attention_form - 70) == -(-(longest_attention_form - 70) // 64) * 64
  assert chunk(longest_attention_form + 1) == 1024
  assert chunk(65536) == 1024
  assert chunk(1024, chunk_size=256) == 256  # a fixed chunk is the caller's
  # The XLA path keeps its own: its attention form would hold T^2 scores per head.
  assert chunk(1024, implementation="xla") == 128


def test_outputs_and_gradients_agree_on_both_sides_of_the_form_switch(monkeypatch):
  """With the kernels' chunk shrunk to 64, head dim 32 and value dim 16 switch from the
  attention form to chunks above 2 D d_v / d + 64 = 592 tokens (D = 528): both sides match
  the reference."""
  from castle_jax.ops.power import api, resolve

  monkeypatch.setattr(api, "TRITON_DEFAULT_CHUNK_SIZE", 64)
  sizes = dict(p=2, head_dim=D_HEAD, value_dim=D_VALUE, dtype=jnp.float32)
  for seq, chunk in ((570, 576), (600, 64)):
    assert resolve("triton", None, seq_len=seq, **sizes)[1] == chunk
    inputs = _inputs(20 + seq, seq=seq)
    cotangent = jnp.asarray(np.random.default_rng(seq).standard_normal((B, seq, HQ, D_VALUE)), jnp.float32)

    def loss(impl, *args):
      return jnp.sum(power_attention(*args, implementation=impl) * cotangent)

    out = power_attention(*inputs, implementation="triton")
    assert rel_err(out, power_attention(*inputs, implementation="reference")) < 1e-4, seq
    grads = jax.jit(jax.grad(functools.partial(loss, "triton"), argnums=range(4)))(*inputs)
    expected = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums=range(4)))(*inputs)
    for name, g, e in zip(("q", "k", "v", "log_g"), grads, expected):
      assert rel_err(g, e) < 1e-4, (seq, name)


def test_triton_default_chunk_follows_the_sequence(monkeypatch):
  import pallas_kernels.power as kernels_package
  from castle_jax.ops.power import api

  seen = {}

  def spy(*args, chunk_size, **kwargs):
    seen["chunk_size"] = chunk_size
    return kernels_package.triton.power_attention_triton(*args, chunk_size=chunk_size, **kwargs)

  monkeypatch.setattr(api, "power_attention_triton", spy)
  inputs = _inputs(13, seq=8)
  power_attention(*inputs, implementation="triton")
  assert seen["chunk_size"] == 64  # the attention form: 8 tokens rounded up to one 64-token block
  power_attention(*inputs, implementation="triton", chunk_size=128)
  assert seen["chunk_size"] == 128


@pytest.mark.usefixtures("tile_pair_loop")
def test_forward_and_backward_lower_for_an_h100():
  # Interpret mode never builds Triton IR: a construct the Triton lowering rejects (an integer
  # remainder inside nested loops is one) shows only here or on a GPU. Grouped heads, two chunks.
  inputs = _inputs(17, seq=2048, dtype=jnp.bfloat16)
  initial = _state(18, expansion="tspow", d_tile=16)

  def loss(q, k, v, log_g, state, normalizer):
    out, (final_state, _) = power_attention_triton(
      q, k, v, log_g, scale=D_HEAD**-0.5, chunk_size=1024, initial_state=(state, normalizer), interpret=False
    )
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final_state)

  text = lowered_for_h100(jax.grad(loss, argnums=range(6)), (*inputs, *initial))
  for kernel in (
    "power_update_state",
    "power_discumsum",
    "power_query_state_attention",
    "power_reverse_discumsum",
    "power_state_gradient",
  ):
    assert kernel in text, kernel
