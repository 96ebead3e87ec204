"""Several seeds of one config (`train.seeds`): the vmapped run of N seeds equals N separate
runs (losses, evaluations, final parameters), also across a signal and a crash; each seed's
workdir is a normal one; bad settings are one clear error."""

import json
import os
import re
import signal
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from castle_jax.checkpoints import CheckpointError
from castle_jax.workdir import load_trained_model, read_config
from configs import tiny
from helpers import Interrupt, tiny_run
from train.metrics import read_metrics
from train.seeds import check_fits, resume_step_of_seeds, seed_config
from train.signals import TrainingInterrupted
from train.trainer import train

# Its module-scoped fixtures are costly (trained models, compiled steps): one worker runs the
# whole module under `--dist loadgroup`, so they are built once.
pytestmark = pytest.mark.xdist_group("test_seeds")

# float32 runs of one seed, vmapped or not, differ by rounding only.
TOLERANCE = dict(rtol=1e-6, atol=1e-6)
# Adam divides by sqrt(v): where a gradient element is near zero, a rounding difference moves
# its update by more than the gradient's rounding (seen: 1.1e-6 after two steps, fsdp x tensor).
PARAMS_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _records(workdir, split="train", name="metrics.jsonl"):
  return read_metrics(os.path.join(workdir, name), split=split)


def _seed_run(data_dir, workdir, seed, **overrides):
  """A single run of seed `seed` as a run of several seeds trains it."""
  config = tiny_run(tiny, workdir, data_dir, **{"train.eval_batches": 1, **overrides})
  with config.unlocked():
    config.seed = seed
    config.data.shuffle_seed = seed
  return config


@pytest.fixture(scope="module")
def seed_one_run(tmp_path_factory, stdlib_data_dir):
  """Seed 1 trained alone (seed 0 alone is `finished_tiny_run`)."""
  config = _seed_run(stdlib_data_dir, str(tmp_path_factory.mktemp("seed_one") / "run"), 1)
  result = train(config)
  return types.SimpleNamespace(config=config, result=result)


def _assert_equals_separate_run(seed_dir, separate_dir, final_params, separate_params, exact=False):
  ours, theirs = _records(seed_dir), _records(separate_dir)
  assert sorted(ours) == sorted(theirs) == list(range(1, 9))
  compare = np.testing.assert_array_equal if exact else lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE)
  compare([ours[s]["loss"] for s in ours], [theirs[s]["loss"] for s in theirs])
  compare([ours[s]["grad_norm"] for s in ours], [theirs[s]["grad_norm"] for s in theirs])
  ours_eval, theirs_eval = _records(seed_dir, "eval"), _records(separate_dir, "eval")
  assert sorted(ours_eval) == sorted(theirs_eval) == [4, 8]
  compare([r["loss"] for r in ours_eval.values()], [r["loss"] for r in theirs_eval.values()])
  for a, b in zip(jax.tree.leaves(final_params), jax.tree.leaves(separate_params)):
    compare(np.asarray(a), np.asarray(b))


def test_vmapped_seeds_equal_separate_runs_across_a_signal_and_a_crash(
  tiny_run_config, finished_tiny_run, seed_one_run, capfd
):
  """Two seeds in one vmapped step under the 8-device mesh: SIGTERM after step 3 (every seed
  saves step 3), a crash after step 6 (no save: the seeds resume from step 4), then the rest.
  Steps 5 and 6 ran twice: the resumed run repeats the first one bit for bit."""
  config = tiny_run_config
  with config.unlocked():
    config.train.eval_batches = 1
    config.train.seeds = 2
  top = config.workdir

  def sigterm_at_3(step):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(TrainingInterrupted, match=r"SIGTERM after step 3.*seed_\*/checkpoints/3"):
    train(config, after_step=sigterm_at_3)

  def crash_at_6(step):
    if step == 6:
      raise Interrupt()

  with pytest.raises(Interrupt):
    train(config, after_step=crash_at_6)
  capfd.readouterr()
  results = train(config)
  out, _ = capfd.readouterr()
  assert f"start     resumed from step 4 ({top}/seed_*/checkpoints/4)" in out
  assert re.search(
    r"^ready     [\d.]+s after the start: model and mesh [\d.]+s, data [\d.]+s, parameters [\d.]+s, other [\d.]+s$",
    out,
    re.M,
  )
  assert out.strip().splitlines()[-1] == f"Finished step 8 of 8; saved checkpoints {top}/seed_*/checkpoints/8 (2 seeds)"
  assert json.load(open(os.path.join(top, "seeds.json"))) == {"seeds": 2, "seeds_mode": "vmap"}

  separate = [finished_tiny_run, seed_one_run]
  for k, result in enumerate(results):
    seed_dir = os.path.join(top, f"seed_{k}")
    _assert_equals_separate_run(
      seed_dir, separate[k].config.workdir, result.state.params, separate[k].result.state.params
    )
    # The crash repeated steps 5 and 6: the same values, the first ones set aside.
    repeated = _records(seed_dir, name="metrics_set_aside.jsonl")
    assert sorted(repeated) == [5, 6]
    for step in (5, 6):
      assert repeated[step]["loss"] == _records(seed_dir)[step]["loss"], (k, step)
    # Elapsed training time runs on across the restarts.
    elapsed = [r["elapsed_s"] for r in _records(seed_dir).values()]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    # A seed's workdir is a normal one: its config, its checkpoint.
    saved = read_config(seed_dir)
    assert (saved.seed, saved.data.shuffle_seed, saved.train.seeds, saved.workdir) == (k, k, None, seed_dir)
    _, params, _, step = load_trained_model(seed_dir)
    assert step == 8
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(result.state.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sequential_seeds_are_the_separate_runs(tmp_path, stdlib_data_dir, finished_tiny_run, seed_one_run):
  config = tiny_run(tiny, str(tmp_path / "runs"), stdlib_data_dir, **{"train.eval_batches": 1, "train.seeds": 2})
  with config.unlocked():
    config.train.seeds_mode = "sequential"
  results = train(config)
  separate = [finished_tiny_run, seed_one_run]
  for k, result in enumerate(results):
    _assert_equals_separate_run(
      str(tmp_path / "runs" / f"seed_{k}"),
      separate[k].config.workdir,
      result.state.params,
      separate[k].result.state.params,
      exact=True,
    )
  assert json.load(open(tmp_path / "runs" / "seeds.json")) == {"seeds": 2, "seeds_mode": "sequential"}


def test_the_vmapped_step_keeps_every_axis_but_the_seeds_sharded(stdlib_data_dir, tmp_path):
  """Under a data x fsdp x tensor mesh the stacked state and batch are sharded as one run's,
  with an unsharded seed axis in front, and each seed steps as the single-run step does."""
  import flax.linen as nn

  from castle_jax.sharding import LOGICAL_AXIS_RULES
  from train.state import init_train_state, seed_state_getter, stack_states, state_shardings
  from train.step import jit_seeds_train_step, jit_train_step
  from train.trainer import build_run

  config = tiny_run(tiny, str(tmp_path / "run"), stdlib_data_dir, **{"mesh.fsdp": 2, "mesh.tensor": 2})
  run = build_run(config)
  assert dict(run.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  with jax.set_mesh(run.mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
    _, shardings = state_shardings(run.model, run.tx, run.mesh, config.data.seq_len)
    states = [init_train_state(run.model, run.tx, jax.random.key(k), config.data.seq_len, shardings) for k in (0, 1)]
    stacked = stack_states(states, shardings)
    for leaf, one in zip(jax.tree.leaves(stacked), jax.tree.leaves(shardings)):
      assert leaf.sharding.spec == jax.sharding.PartitionSpec(None, *one.spec)
    assert any(axis for one in jax.tree.leaves(shardings.params) for axis in one.spec)  # sharded parameters
    options = dict(model=run.model, tx=run.tx, schedule=run.schedule, pad_id=run.tokenizer.pad_id, grad_accum_steps=1)
    one_step = [
      jit_train_step(**options, state_shardings=shardings, batch_sharding=run.batch_sharding, seed=k) for k in (0, 1)
    ]
    seeds_step = jit_seeds_train_step(**options, state_shardings=shardings, batch_sharding=run.batch_sharding)
    tokens = np.asarray(jax.random.randint(jax.random.key(5), (2, 8, 33), 0, 256), np.int32)
    batches = [{"inputs": tokens[k, :, :-1], "targets": tokens[k, :, 1:]} for k in (0, 1)]
    stacked_batch = {key: np.stack([b[key] for b in batches]) for key in batches[0]}
    for _ in range(2):
      stacked, metrics = seeds_step(stacked, stacked_batch, jnp.asarray([0, 1], jnp.int32))
      step_metrics = []
      for k in (0, 1):
        states[k], m = one_step[k](states[k], batches[k])
        step_metrics.append(float(m["loss"]))
      np.testing.assert_allclose(np.asarray(metrics["loss"]), step_metrics, **TOLERANCE)
    assert metrics["loss"].shape == (2,)
    seed_state = seed_state_getter(shardings)
    for k in (0, 1):
      for a, b, one in zip(
        jax.tree.leaves(seed_state(stacked, k)), jax.tree.leaves(states[k]), jax.tree.leaves(shardings)
      ):
        assert a.sharding == one
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **PARAMS_TOLERANCE)


def test_processes_with_disjoint_seed_indices_fill_one_run_of_several_seeds(
  tmp_path, stdlib_data_dir, finished_tiny_run, seed_one_run
):
  """Seed 1 into a fresh workdir, then seed 0 while seed 1's workdir is locked (as a process
  training it holds it), each by its own `train()` call: the workdir is the one `train.seeds=2`
  trains, seed by seed the separate runs bit for bit, and compare reads it as one arm."""
  from castle_jax.eval.compare import load_arm
  from train.workdir_lock import acquire_lock

  top = str(tmp_path / "runs")
  config = tiny_run(tiny, top, stdlib_data_dir, **{"train.eval_batches": 1, "train.seeds": 2})
  with config.unlocked():
    config.train.seeds_mode = "sequential"
  separate = [finished_tiny_run, seed_one_run]
  for index in (1, 0):
    held = acquire_lock(os.path.join(top, "seed_1")) if index == 0 else None
    try:
      with config.unlocked():
        config.train.seed_indices = (index,)
      (result,) = train(config)
    finally:
      if held is not None:
        held.release()
    _assert_equals_separate_run(
      os.path.join(top, f"seed_{index}"),
      separate[index].config.workdir,
      result.state.params,
      separate[index].result.state.params,
      exact=True,
    )
    assert sorted(os.listdir(top)) == ["seed_0", "seed_1", "seeds.json"][index:]
    assert json.load(open(os.path.join(top, "seeds.json"))) == {"seeds": 2, "seeds_mode": "sequential"}
    saved = read_config(os.path.join(top, f"seed_{index}"))
    assert (saved.seed, saved.data.shuffle_seed, saved.train.seeds, saved.train.seed_indices) == (
      index,
      index,
      None,
      None,
    )
  arm, _ = load_arm(top, "metrics", "eval_loss")
  assert sorted(arm.seeds) == [0, 1] and arm.count == 2
  # Another seed count than the run's is refused, as for a whole run.
  with config.unlocked():
    config.train.seeds, config.train.seed_indices = 3, (2,)
  with pytest.raises(ValueError, match=r"holds a run of 2 seeds, not train.seeds=3"):
    train(config)
  assert not os.path.exists(os.path.join(top, "seed_2"))


def test_vmapped_seed_indices_train_those_seeds_only(tmp_path, stdlib_data_dir, seed_one_run):
  top = str(tmp_path / "runs")
  config = tiny_run(
    tiny, top, stdlib_data_dir, **{"train.eval_batches": 1, "train.seeds": 3, "train.seed_indices": (1,)}
  )
  (result,) = train(config)
  assert sorted(os.listdir(top)) == ["seed_1", "seeds.json"]
  assert json.load(open(os.path.join(top, "seeds.json"))) == {"seeds": 3, "seeds_mode": "vmap"}
  _assert_equals_separate_run(
    os.path.join(top, "seed_1"), seed_one_run.config.workdir, result.state.params, seed_one_run.result.state.params
  )


# --- bad settings: one clear line each, before anything is written -------------------------------


@pytest.mark.parametrize(
  "settings, match",
  [
    ({"train.seeds": 0}, r"train.seeds must be an integer >= 1 \(or None: one run in the workdir\), got 0"),
    ({"train.seeds": -2}, r"train.seeds must be an integer >= 1 .*got -2"),
    ({"train.seeds": 2, "train.seeds_mode": "parallel"}, r"train.seeds_mode must be one of \('vmap', 'sequential'\)"),
    ({"train.seeds": 2, "seed": 3}, r"seed=3 and data.shuffle_seed=0 cannot be combined with train.seeds=2"),
    ({"train.seeds": 2, "data.shuffle_seed": 1}, r"leave both at 0"),
    ({"train.seeds": 2, "data.batch_size": 7}, r"data.batch_size \(7\) must be a positive multiple"),
    ({"train.seed_indices": (0,)}, r"train.seed_indices=\(0,\) needs train.seeds=N, the run's seed count"),
    (
      {"train.seeds": 2, "train.seed_indices": (2,)},
      r"distinct integers in \[0, train.seeds=2\), got \(2,\) \(2 not\)",
    ),
    ({"train.seeds": 2, "train.seed_indices": (-1, 0)}, r"got \(-1, 0\) \(-1 not\)"),
    ({"train.seeds": 2, "train.seed_indices": ("a",)}, r"got \('a',\) \('a' not\)"),
    ({"train.seeds": 2, "train.seed_indices": (True,)}, r"got \(True,\) \(True not\)"),
    ({"train.seeds": 2, "train.seed_indices": ()}, r"must be a non-empty tuple .*got \(\)"),
    ({"train.seeds": 3, "train.seed_indices": (1, 2, 1)}, r"got \(1, 2, 1\) \(1 twice\)"),
    (
      {"train.seeds": 2, "train.seed_indices": (0,), "train.resume": False, "train.overwrite": True},
      r"train.overwrite=True moves the whole run of 2 seeds aside.*new --workdir",
    ),
  ],
)
def test_bad_seed_settings_are_one_clear_error(tiny_run_config, settings, match):
  config = tiny_run_config
  with config.unlocked():
    for key, value in settings.items():
      section, _, name = key.rpartition(".")
      (config[section] if section else config)[name] = value
  with pytest.raises(ValueError, match=match) as error:
    train(config)
  assert "\n" not in str(error.value)
  assert not os.path.exists(config.workdir)


def test_a_run_of_several_seeds_and_a_single_run_never_share_a_workdir(tiny_run_config):
  config = tiny_run_config
  workdir = config.workdir
  os.makedirs(workdir)
  open(os.path.join(workdir, "metrics.jsonl"), "w").close()  # a single run's file
  with config.unlocked():
    config.train.seeds = 2
  with pytest.raises(ValueError, match=r"holds a single-seed run \(metrics.jsonl\); train.seeds=2 .*new --workdir"):
    train(config)

  os.remove(os.path.join(workdir, "metrics.jsonl"))
  with open(os.path.join(workdir, "seeds.json"), "w") as f:
    json.dump({"seeds": 3, "seeds_mode": "vmap"}, f)
  with pytest.raises(ValueError, match=r"holds a run of 3 seeds, not train.seeds=2: pass --config.train.seeds=3"):
    train(config)
  with config.unlocked():
    config.train.seeds = None
  with pytest.raises(ValueError, match=r"holds a run of 3 seeds \(seeds.json\): pass --config.train.seeds=3.*seed_0"):
    train(config)
  # Tools that read one run name a seed's workdir instead.
  with pytest.raises(FileNotFoundError, match=r"holds a run of 3 seeds, not one run: pass one seed's workdir, e\.g\."):
    read_config(workdir)


def test_init_from_a_run_of_several_seeds_starts_seed_k_from_its_seed_k(
  tmp_path, stdlib_data_dir, finished_tiny_run, seed_one_run, capsys
):
  """Vmapped seeds fine-tuned from a run of two seeds: seed k starts from the source's seed k
  (seed 1 equals a single run started from the source's seed_1) and records it; a source
  with fewer seeds than the run is one error line, before anything is written."""
  import shutil

  source = tmp_path / "source"
  for k, run in enumerate([finished_tiny_run, seed_one_run]):
    shutil.copytree(run.config.workdir, source / f"seed_{k}", ignore=shutil.ignore_patterns(".lock"))
  (source / "seeds.json").write_text(json.dumps({"seeds": 2, "seeds_mode": "vmap"}))
  overrides = {"train.init_from": str(source), "train.steps": 2, "train.eval_every": 2, "train.checkpoint_every": 2}
  config = tiny_run(tiny, str(tmp_path / "fine_tune"), stdlib_data_dir, **overrides, **{"train.seeds": 2})
  train(config)
  alone = _seed_run(
    stdlib_data_dir, str(tmp_path / "alone"), 1, **{**overrides, "train.init_from": str(source / "seed_1")}
  )
  train(alone)
  for k in range(2):
    seed_dir = tmp_path / "fine_tune" / f"seed_{k}"
    assert read_config(str(seed_dir)).train.init_from == str(source / f"seed_{k}")
    assert _records(str(seed_dir), split="init_from")[0]["source_step"] == 8
  ours, theirs = _records(str(tmp_path / "fine_tune" / "seed_1")), _records(alone.workdir)
  np.testing.assert_allclose([ours[s]["loss"] for s in (1, 2)], [theirs[s]["loss"] for s in (1, 2)], **TOLERANCE)

  # A process of only some seeds names each by its index, not by its place in the process.
  only_one = tiny_run(
    tiny, str(tmp_path / "only_one"), stdlib_data_dir, **overrides, **{"train.seeds": 2, "train.seed_indices": (1,)}
  )
  capsys.readouterr()
  train(only_one)
  printed = "".join(capsys.readouterr())
  assert f"seed 1: parameters of step 8 of {source / 'seed_1'}" in printed, printed

  more = tiny_run(tiny, str(tmp_path / "three"), stdlib_data_dir, **overrides, **{"train.seeds": 3})
  with pytest.raises(ValueError, match=r"holds a run of 2 seeds and seed k starts from its seed k: train.seeds=3"):
    train(more)
  assert not os.path.exists(more.workdir)


def test_seed_configs_depend_on_the_index_alone(tiny_run_config):
  config = tiny_run_config
  with config.unlocked():
    config.train.seeds = 4
  for k in range(4):
    seeded = seed_config(config, k)
    assert (seeded.seed, seeded.data.shuffle_seed, seeded.train.seeds) == (k, k, None)
    assert seeded.workdir == os.path.join(config.workdir, f"seed_{k}")
  assert config.seed == 0 and config.train.seeds == 4  # the original is unchanged


class _Checkpoints:
  """What `resume_step_of_seeds` reads of a seed's checkpointer."""

  def __init__(self, steps, damaged=()):
    self.steps, self.damaged, self.directory = steps, damaged, "/runs/x/seed_k/checkpoints"

  def all_steps(self):
    return list(self.steps)

  def verify(self, step):
    return "corrupted" if step in self.damaged else None


def test_the_seeds_resume_from_the_newest_step_they_all_hold_undamaged(tiny_run_config):
  t = tiny_run_config.train
  assert resume_step_of_seeds(t, [_Checkpoints([]), _Checkpoints([])]) is None
  # Killed while saving step 8: one seed has it, the other does not.
  assert resume_step_of_seeds(t, [_Checkpoints([4, 8]), _Checkpoints([4])]) == 4
  assert resume_step_of_seeds(t, [_Checkpoints([4, 8]), _Checkpoints([4, 8], damaged=[8])]) == 4
  with pytest.raises(CheckpointError, match=r"Seeds \[1\] have no checkpoint.*seeds_mode=sequential"):
    resume_step_of_seeds(t, [_Checkpoints([4]), _Checkpoints([])])
  with pytest.raises(CheckpointError, match="No checkpoint step is held undamaged by every seed"):
    resume_step_of_seeds(t, [_Checkpoints([4]), _Checkpoints([4], damaged=[4])])


def test_seeds_that_do_not_fit_the_device_name_the_sequential_mode():
  memory = types.SimpleNamespace(
    argument_size_in_bytes=6 << 30,
    output_size_in_bytes=6 << 30,
    alias_size_in_bytes=6 << 30,
    temp_size_in_bytes=3 << 30,
  )
  check_fits(memory, 10 << 30, seeds=8)  # 9 GiB of 10
  check_fits(memory, None, seeds=8)  # a CPU reports no limit
  with pytest.raises(ValueError, match=r"train.seeds=8 vmapped in one step need 9.0 GiB per device and a device has "):
    check_fits(memory, 8 << 30, seeds=8)


def test_a_family_with_frozen_parameters_names_the_sequential_mode(tmp_path, stdlib_data_dir):
  from configs import longspec_draft_tiny

  config = tiny_run(longspec_draft_tiny, str(tmp_path / "draft"), stdlib_data_dir, **{"train.seeds": 2})
  with pytest.raises(ValueError, match=r"model.family='longspec_draft' trains against frozen parameters.*sequential"):
    train(config)
  assert not os.path.exists(config.workdir)
