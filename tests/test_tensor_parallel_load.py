"""A trained model loaded straight onto a tensor-parallel mesh (`load_trained_model(...,
mesh=tensor_parallel_mesh(N))`, the commands' --tensor=N) decodes and evaluates as on one
device, on 8 fake CPU devices: a Hugging Face directory (tests/fixtures/hf, 2 key/value
heads: N=2) and a training workdir of 4 heads (N=2 and 4)."""

import json
import os

import jax
import numpy as np
import pytest

import forked_commands
from castle_jax.eval import passkey, perplexity
from castle_jax.sharding import on_mesh
from castle_jax.workdir import load_draft, load_trained_model, tensor_parallel_mesh
from configs import longspec_draft_tiny, tiny
from helpers import tiny_run
from test_hf_import import FIXTURES
from train.generate import continue_prompt
from train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "the quick brown fox"
HF_DIR = os.path.join(FIXTURES, "qwen2")


def _prompt(tokenizer):
  return np.concatenate([[tokenizer.bos_id], tokenizer.encode(PROMPT)]).astype(np.int32)


def _spec(params, *path):
  for key in path:
    params = params[key]
  return tuple(params.sharding.spec)


def _decode(workdir, tensor, max_new_tokens=8):
  mesh = tensor_parallel_mesh(tensor)
  target = load_trained_model(workdir, mesh=mesh)
  with on_mesh(mesh):
    tokens, _ = continue_prompt(target, _prompt(target.tokenizer), max_new_tokens=max_new_tokens)
  return target, tokens


def _perplexity(workdir, tensor, data_dir, tmp_path):
  output = tmp_path / f"perplexity_tensor{tensor}.json"
  args = [f"--workdir={workdir}", "--lengths=16,32", "--windows=2", f"--data_dir={data_dir}", f"--output={output}"]
  assert perplexity.main([*args, f"--tensor={tensor}"]) == 0
  return [(r["length"], r["tokens"], r["loss"]) for r in json.loads(output.read_text())["results"]]


def _passkey(workdir, tensor, data_dir, tmp_path):
  output = tmp_path / f"passkey_tensor{tensor}.json"
  args = [f"--workdir={workdir}", "--lengths=128", "--examples=2", f"--data_dir={data_dir}", f"--output={output}"]
  assert passkey.main([*args, f"--tensor={tensor}"]) == 0
  return [[e["first_token"], e["all_tokens"]] for e in json.loads(output.read_text())["results"][0]["per_example"]]


def _commands(*command_lines):
  """A CompletedProcess for each `python *args` in `command_lines`, on 8 CPU devices."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
  env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
  results, _ = forked_commands.run([list(args) for args in command_lines], ROOT, env, timeout=300)
  return results


@pytest.fixture(scope="module")
def four_head_workdir(tmp_path_factory, stdlib_data_dir):
  """A 2-step tiny run with 4 attention and 4 key/value heads (tensor-parallel up to 4 ways)."""
  workdir = tmp_path_factory.mktemp("four_heads") / "run"
  overrides = {"model.n_heads": 4, "train.steps": 2, "train.checkpoint_every": 2, "train.eval_every": 2}
  train(tiny_run(tiny, str(workdir), stdlib_data_dir, **overrides))
  return str(workdir)


def test_an_hf_directory_loads_into_shards_and_decodes_and_evaluates_as_on_one_device(stdlib_data_dir, tmp_path):
  one, alone = _decode(HF_DIR, 1)
  two, sharded = _decode(HF_DIR, 2)
  np.testing.assert_array_equal(sharded, alone)
  kernel = two.params["block_0"]["attention"]["query"]["kernel"]  # [embed, heads, head_dim]
  assert _spec(two.params, "block_0", "attention", "query", "kernel") == ("fsdp", "tensor", None)
  assert kernel.sharding.mesh.shape["tensor"] == 2 and kernel.sharding.mesh.size == 2
  assert {shard.data.shape for shard in kernel.addressable_shards} == {(32, 2, 8)}  # 4 heads, 2 per device
  assert _spec(two.params, "block_0", "mlp", "w_up", "kernel") == ("fsdp", "tensor")
  assert isinstance(one.params["block_0"]["mlp"]["w_up"]["kernel"].sharding, jax.sharding.SingleDeviceSharding)
  ours, theirs = _perplexity(HF_DIR, 2, stdlib_data_dir, tmp_path), _perplexity(HF_DIR, 1, stdlib_data_dir, tmp_path)
  assert [r[:2] for r in ours] == [r[:2] for r in theirs]
  np.testing.assert_allclose([r[2] for r in ours], [r[2] for r in theirs], rtol=1e-5)


def test_a_workdir_loads_into_shards_and_decodes_and_evaluates_as_on_one_device(
  four_head_workdir, stdlib_data_dir, tmp_path
):
  _, alone = _decode(four_head_workdir, 1)
  reference = _perplexity(four_head_workdir, 1, stdlib_data_dir, tmp_path)
  for tensor in (2, 4):
    target, sharded = _decode(four_head_workdir, tensor)
    np.testing.assert_array_equal(sharded, alone)
    kernel = target.params["block_0"]["attention"]["query"]["kernel"]
    assert tuple(kernel.sharding.spec) == ("fsdp", "tensor", None)
    assert {shard.data.shape[1] for shard in kernel.addressable_shards} == {4 // tensor}
    ours = _perplexity(four_head_workdir, tensor, stdlib_data_dir, tmp_path)
    assert [r[:2] for r in ours] == [r[:2] for r in reference]
    np.testing.assert_allclose([r[2] for r in ours], [r[2] for r in reference], rtol=1e-5)
  assert _passkey(four_head_workdir, 4, stdlib_data_dir, tmp_path) == _passkey(
    four_head_workdir, 1, stdlib_data_dir, tmp_path
  )


def test_a_draft_decodes_speculatively_on_the_targets_mesh(stdlib_data_dir, tmp_path):
  config = tiny_run(
    longspec_draft_tiny, str(tmp_path / "draft"), stdlib_data_dir, **{"train.steps": 2, "train.checkpoint_every": 2}
  )
  with config.unlocked():
    config.model.family_kwargs.target_workdir = HF_DIR
    config.model.family_kwargs.window = 16
    config.model.family_kwargs.max_offset = 32
  train(config)
  alone = _decode(HF_DIR, 1, max_new_tokens=12)[1]
  mesh = tensor_parallel_mesh(2)
  target = load_trained_model(HF_DIR, mesh=mesh)
  draft = load_draft(config.workdir, target, mesh=mesh)  # its fingerprint check reads the sharded target
  assert _spec(draft.params, "self_attention", "query", "kernel") == ("fsdp", "tensor", None)
  with on_mesh(mesh):
    speculative, line = continue_prompt(target, _prompt(target.tokenizer), max_new_tokens=12, draft=draft, tree=(2, 4))
  np.testing.assert_array_equal(speculative, alone)
  assert line.startswith("# speculative: draft step 2, tree [2, 4]: tau")


def test_the_generate_command_with_tensor_prints_the_one_device_tokens():
  target, alone = _decode(HF_DIR, 1)
  args = ["-m", "train.generate", f"--workdir={HF_DIR}", f"--prompt={PROMPT}", "--max_new_tokens=8", "--temperature=0"]
  # The three command lines run in processes forked from one that has imported jax and the
  # other large packages once (tests/forked_commands.py), not in three fresh interpreters.
  decoded, indivisible, too_many = _commands(*([*args, f"--tensor={tensor}"] for tensor in (2, 3, 4)))
  assert decoded.returncode == 0, decoded.stderr[-2000:]
  assert decoded.stdout.splitlines()[-1] == target.tokenizer.decode(alone[1:])
  assert indivisible.returncode == 1
  assert indivisible.stderr.strip().splitlines()[-1] == (
    "ERROR: --tensor=3 must divide the 8 devices (cpu): pass one of 1, 2, 4, 8"
  )
  assert too_many.returncode == 1
  assert too_many.stderr.strip().splitlines()[-1] == (
    "ERROR: --tensor=4 does not divide the model's 4 attention heads and 2 key/value heads: pass --tensor=1 or "
    "--tensor=2"
  )


def test_bad_tensor_values_are_one_error_line(stdlib_data_dir, capsys):
  assert jax.device_count() == 8
  base = [f"--workdir={HF_DIR}", "--lengths=16", "--windows=1", f"--data_dir={stdlib_data_dir}"]
  for tensor, message in [
    ("3", "ERROR: --tensor=3 must divide the 8 devices (cpu): pass one of 1, 2, 4, 8"),
    ("0", "ERROR: --tensor=0 must divide the 8 devices (cpu): pass one of 1, 2, 4, 8"),
    (
      "8",
      "ERROR: --tensor=8 does not divide the model's 4 attention heads and 2 key/value heads: pass --tensor=1 or "
      "--tensor=2",
    ),
  ]:
    assert perplexity.main([*base, f"--tensor={tensor}"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == message
  assert perplexity.main(["--pretrained=drt_tiny_retrieval_topk", "--lengths=16", "--tensor=2"]) == 1
  assert (
    capsys.readouterr()
    .err.strip()
    .endswith("--tensor must be 1 with --pretrained (a shipped model loads onto one device), got 2")
  )
