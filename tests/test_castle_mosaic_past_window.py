"""CASTLE-SWL's forward split in two Mosaic GPU kernels: the key-major sweep inside the
window and the query-major kernel past it (`pallas_kernels.castle.mosaic_past_window`).

CPU only: GPU interpret mode for the numbers (in a fresh process, as
test_castle_mosaic.py explains), the H100 lowering for the kernels' shapes and layouts,
and the partition of the (key block, query block) pairs between the two kernels. The
GPU test file (test_gpu_castle_mosaic.py) runs the split at real sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import mosaic_kernels_lowered_for_h100, rel_err
from pallas_kernels.castle import CastleKernelConfig
from pallas_kernels.castle.mosaic_attention import castle_attention_mosaic
from pallas_kernels.castle.mosaic_config import CastleMosaicConfig
from pallas_kernels.castle.mosaic_forward import key_major_sweep_end
from pallas_kernels.castle.mosaic_ops import castle_forward_mosaic
from pallas_kernels.castle.mosaic_past_window import past_window_key_programs
from test_castle_mosaic import _INTERPRET_XLA_FLAG, TESTS_DIR, _inputs, _reference_lse

BLOCK = 64
PROGRAM = 2 * BLOCK
# (seq, head_dim, window): windows of one token, below a block, one block exactly, and
# above a key program; every case has query programs past the window of some keys.
CASES = [(520, 64, 128), (640, 128, 5), (600, 64, 100)]


@pytest.mark.parametrize("window", [1, 5, 63, 64, 65, 100, 127, 128, 129, 256, 300, 512, 1000])
@pytest.mark.parametrize("length", [128, 256, 640, 1024])
def test_the_two_sweeps_cover_every_pair_once(length, window):
  """Every (key block, query block) pair from the key program's first query block on runs
  in exactly one kernel, and the query-major kernel gets only pairs where every key is
  past its lookahead window."""
  num_query_blocks = length // BLOCK
  covered = np.zeros((num_query_blocks, num_query_blocks), int)  # [key block, query block]
  for program in range(length // PROGRAM):
    end = int(
      key_major_sweep_end(
        jnp.int32(program), window=window, block_q=BLOCK, block_k=BLOCK, num_query_blocks=num_query_blocks
      )
    )
    for key_block in (2 * program, 2 * program + 1):
      covered[key_block, 2 * program : end] += 1
  for query_program in range(length // PROGRAM):
    key_programs = int(
      past_window_key_programs(
        jnp.int32(query_program), window=window, keys_per_program=PROGRAM, queries_per_program=PROGRAM
      )
    )
    assert key_programs <= query_program
    if key_programs:
      last_key, first_query = key_programs * PROGRAM - 1, query_program * PROGRAM
      assert first_query > last_key + window  # W = 0 for every pair of these blocks
    covered[: 2 * key_programs, 2 * query_program : 2 * query_program + 2] += 1
  key_blocks, query_blocks = np.indices(covered.shape)
  expected = (query_blocks >= key_blocks // 2 * 2).astype(int)
  np.testing.assert_array_equal(covered, expected)


def _case(number):
  """(inputs, output cotangent, window) of CASES[number]."""
  seq, head_dim, window = CASES[number]
  keys = jax.random.split(jax.random.key(seq + window), 7)
  shape = (1, seq, 2, head_dim)
  inputs = tuple(jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16) for k in keys[:6])
  return inputs, jax.random.normal(keys[6], shape, jnp.float32).astype(jnp.bfloat16), window


# The kernels' ways with the pairs past the window: query-major kernels for the forward and
# dQ^C, the key side in a kernel of its own (default) or in the key-major sweep; or all of
# it in the key-major sweeps.
VARIANTS = {
  "query_major": CastleMosaicConfig(),
  "key_major": CastleMosaicConfig(past_window="key_major"),
  "key_grads_in_sweep": CastleMosaicConfig(past_window_key_grads="key_major_sweep"),
  "step_keys_64": CastleMosaicConfig(past_window_step_keys=64),
}
# Variants that differ from the default only in the forward: their gradients are not run.
FORWARD_ONLY = ("step_keys_64",)


def _variants(number):
  """The variants run on CASES[number]: the non-default key side and forward steps on one
  case each (GPU interpret mode is slow)."""
  return {1: ("query_major", "key_major", "key_grads_in_sweep"), 2: ("query_major", "key_major", "step_keys_64")}.get(
    number, ("query_major", "key_major")
  )


def _run_cases_in_this_process(out_dir):
  """Every variant's forward and gradients per case, saved for the test process (the
  subprocess side)."""
  for number in range(len(CASES)):
    inputs, cotangent, window = _case(number)
    scale = inputs[0].shape[-1] ** -0.5
    for past_window in _variants(number):
      config = VARIANTS[past_window]
      result = castle_forward_mosaic(*inputs, scale=scale, window=window, interpret=True, config=config)
      grads = []
      if past_window not in FORWARD_ONLY:
        _, vjp = jax.vjp(lambda *a: castle_attention_mosaic(*a, window=window, config=config, interpret=True), *inputs)
        grads = [np.asarray(g.astype(jnp.float32)) for g in vjp(cotangent)]
      np.savez(
        os.path.join(out_dir, f"{number}_{past_window}.npz"),
        out=np.asarray(result.out.astype(jnp.float32)),
        lse=np.asarray(result.lse),
        keys=np.asarray(result.lookahead_keys),
        grads=np.stack(grads) if grads else np.zeros(0),
      )


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
  out_dir = str(tmp_path_factory.mktemp("past_window"))
  env = dict(
    os.environ,
    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {_INTERPRET_XLA_FLAG}".strip(),
    PYTHONPATH=os.pathsep.join([os.path.dirname(TESTS_DIR), TESTS_DIR]),
    JAX_PLATFORMS="cpu",
  )
  code = f"import test_castle_mosaic_past_window as t; t._run_cases_in_this_process({out_dir!r})"
  run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  return lambda number, past_window: np.load(os.path.join(out_dir, f"{number}_{past_window}.npz"))


@pytest.mark.parametrize("number", range(len(CASES)))
def test_split_forward_matches_the_parallel_form(interpreted, number):
  from castle_jax.ops.castle.blockwise import castle_blockwise_prefill

  inputs, _, window = _case(number)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    ref_out, ref_keys = castle_blockwise_prefill(*f32, window=window)
    ref_lse = _reference_lse(f32, window)
  split, key_major = interpreted(number, "query_major"), interpreted(number, "key_major")
  # bf16 inputs, float16 lookahead products: ~2e-3, as the key-major forward.
  assert rel_err(split["out"], ref_out) < 1e-2
  assert rel_err(split["lse"], ref_lse) < 1e-3
  assert rel_err(split["keys"], ref_keys) < 1e-2
  # The same terms summed in another order: far closer to each other than to the reference.
  assert rel_err(split["out"], key_major["out"]) < 2e-3
  assert rel_err(split["lse"], key_major["lse"]) < 1e-5
  np.testing.assert_array_equal(split["keys"], key_major["keys"])
  if "step_keys_64" in _variants(number):
    # 64-key steps: the same products, summed over 64 keys at a time instead of 128.
    narrow = interpreted(number, "step_keys_64")
    assert rel_err(narrow["out"], split["out"]) < 1e-5 and rel_err(narrow["lse"], split["lse"]) < 1e-6
    assert rel_err(narrow["out"], ref_out) < 1e-2


@pytest.mark.parametrize("number", range(len(CASES)))
def test_split_backward_matches_the_parallel_form(interpreted, number):
  """All six gradients with dQ^C of the past-window pairs from the query-major kernel and
  their key side from its own kernel or the key-major sweep, against autodiff of
  `castle_parallel` and against the key-major backward."""
  from castle_jax.ops.castle.reference import castle_parallel

  inputs, cotangent, window = _case(number)
  f32 = tuple(x.astype(jnp.float32) for x in inputs)
  with jax.default_matmul_precision("highest"):
    _, vjp = jax.vjp(lambda *a: castle_parallel(*a, window=window), *f32)
    ref_grads = vjp(cotangent.astype(jnp.float32))
  key_major = interpreted(number, "key_major")["grads"]
  for variant in (v for v in _variants(number) if v != "key_major" and v not in FORWARD_ONLY):
    split = interpreted(number, variant)["grads"]
    for name, grad, other, ref in zip(("q_u", "k_u", "v_u", "q_c", "k_c", "v_c"), split, key_major, ref_grads):
      assert np.isfinite(grad).all(), f"{variant} d{name}"
      # bf16 gradients, float16 lookahead products: ~3e-3, as the key-major backward.
      assert rel_err(grad, ref) < 1e-2, f"{variant} d{name}: {rel_err(grad, ref):.3g}"
      # The past-window shares are computed differently (float16 dS and P instead of
      # bf16), the others only through the forward's summation order.
      assert rel_err(grad, other) < 2e-3, f"{variant} d{name}: {rel_err(grad, other):.3g}"


def test_split_lowers_for_hopper():
  """Both kernels lower for an H100 (layouts, wgmma shapes and dtypes, TMA, shared memory
  within 227 KB); only CASTLE-SWL with past_window="query_major" runs the second one."""
  inputs = _inputs(0, (1, 256, 2, 128))
  forward = lambda config, window: (
    lambda *a: (
      castle_forward_mosaic(*a, scale=128**-0.5, window=window, config=CastleMosaicConfig(past_window=config)).out
    )
  )
  # Each forward runs its kernels twice: the second time in the overflow rerun's branch.
  counts = mosaic_kernels_lowered_for_h100(
    (forward("query_major", 512), forward("key_major", 512), forward("query_major", None)), inputs
  )
  assert counts == [4, 2, 2], counts
  head_dim_64 = _inputs(0, (1, 256, 2, 64))
  assert mosaic_kernels_lowered_for_h100((forward("query_major", 100),), head_dim_64) == [4]
  # 64-key steps (the default, 128, fills shared memory to within ~2 KB at head dim 128).
  narrow_steps = lambda *a: (
    castle_forward_mosaic(*a, scale=128**-0.5, window=512, config=CastleMosaicConfig(past_window_step_keys=64)).out
  )
  assert mosaic_kernels_lowered_for_h100((narrow_steps,), inputs) == [4]
  # The backward adds the key-side kernel and the query-major dQ^C kernel to the key-major one.
  gradients = lambda **config: jax.grad(
    lambda *a: jnp.sum(
      castle_attention_mosaic(*a, window=512, config=CastleMosaicConfig(**config), interpret=False).astype(jnp.float32)
    ),
    argnums=tuple(range(6)),
  )
  assert mosaic_kernels_lowered_for_h100(
    (gradients(), gradients(past_window_key_grads="key_major_sweep"), gradients(past_window="key_major")), inputs
  ) == [7, 6, 3]


def test_config_names_the_choices():
  with pytest.raises(ValueError, match=r"past_window must be one of \('query_major', 'key_major'\), got 'fast'"):
    CastleMosaicConfig(past_window="fast")
  with pytest.raises(ValueError, match=r"mosaic_past_window must be one of"):
    CastleKernelConfig(mosaic_past_window="fast")
  assert CastleKernelConfig.from_string("mosaic_past_window=key_major").mosaic_config.past_window == "key_major"
  from_string = CastleKernelConfig.from_string("mosaic_past_window_key_grads=key_major_sweep")
  assert from_string.mosaic_config.past_window_key_grads == "key_major_sweep"
  with pytest.raises(ValueError, match=r"mosaic_past_window_key_grads must be one of"):
    CastleKernelConfig(mosaic_past_window_key_grads="fast")
  assert CastleMosaicConfig().splits_past_window
  assert CastleMosaicConfig().splits_past_window_key_grads
  assert not CastleMosaicConfig(past_window="key_major").splits_past_window_key_grads
  with pytest.raises(ValueError, match=r"past_window_key_grads must be one of \('own_kernel', 'key_major_sweep'\)"):
    CastleMosaicConfig(past_window_key_grads="elsewhere")
  assert not CastleMosaicConfig(schedule="simple").splits_past_window
  with pytest.raises(ValueError, match=r"past_window_step_keys must be one of \(64, 128\), got 256"):
    CastleMosaicConfig(past_window_step_keys=256)
  with pytest.raises(ValueError, match=r"mosaic_past_window_step_keys must be one of \(64, 128\), got 32"):
    CastleKernelConfig(mosaic_past_window_step_keys=32)
  assert CastleKernelConfig.from_string("mosaic_past_window_step_keys=64").mosaic_config.past_window_step_keys == 64


@pytest.mark.parametrize("keys_per_program", [1, 2])
@pytest.mark.parametrize("window", [1, 5, 63, 64, 65, 100, 128, 129, 512, 1000])
def test_window_interior_steps_need_no_mask(window, keys_per_program):
  """The key-major sweeps skip the masks from the diagonal to `window_interior_end`: exactly
  the query blocks where every (key, query) pair is inside the lookahead window."""
  from pallas_kernels.castle.mosaic_forward import window_interior_end

  num_query_blocks = 40
  for key_block in range(6):
    keys = np.arange(key_block * BLOCK, (key_block + keys_per_program) * BLOCK)
    diagonal_end = key_block + keys_per_program
    lookahead_end = min(num_query_blocks, (keys[-1] + window) // BLOCK + 1)
    interior_end = int(
      window_interior_end(
        jnp.int32(keys[0]), jnp.int32(diagonal_end), jnp.int32(lookahead_end), window=window, block_q=BLOCK
      )
    )
    assert diagonal_end <= interior_end <= lookahead_end
    for query_block in range(diagonal_end, lookahead_end):
      queries = np.arange(query_block * BLOCK, (query_block + 1) * BLOCK)
      inside = (queries[None] > keys[:, None]) & (queries[None] <= keys[:, None] + window)
      assert inside.all() == (query_block < interior_end), (key_block, query_block, interior_end)
