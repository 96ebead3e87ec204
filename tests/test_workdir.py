"""A workdir belongs to one run and loses nothing: lock, resume/overwrite rules,
config.json after restore, verified checkpoints with fall-back, signals, flushing."""

import copy
import gc
import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import pytest

from castle_jax.checkpoints import MANIFEST_NAME, Checkpointer, CheckpointError, verify_step
from castle_jax.workdir import load_trained_model
from helpers import TINY_RUN_SETTINGS, Interrupt
from train.metrics import MetricsWriter, read_metrics
from train.signals import StopSignals, TrainingInterrupted
from train.state import TrainState
from train import trainer
from train.trainer import train
from train.resume_checks import ConfigMismatchError
from train.run_files import WorkdirNotEmptyError
from train.workdir_lock import WorkdirBusyError, WorkdirLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = TINY_RUN_SETTINGS


@pytest.fixture()
def config(tiny_run_config):
  return tiny_run_config


def _set(config, **values):
  with config.unlocked():
    for key, value in values.items():
      section, name = key.split("__")
      config[section][name] = value
  return config


def _losses(workdir):
  return {s: r["loss"] for s, r in read_metrics(os.path.join(workdir, "metrics.jsonl")).items()}


# --- ownership -----------------------------------------------------------------------------------


def test_a_rerun_never_mixes_runs_nor_replaces_config_json_and_overwrite_moves_the_old_run(config, tmp_path):
  _set(config, train__steps=4)
  train(config)
  first_losses = _losses(config.workdir)
  checkpoint_mtime = os.path.getmtime(os.path.join(config.workdir, "checkpoints", "4"))
  config_path = os.path.join(config.workdir, "config.json")
  saved = open(config_path).read()

  # A changed model is one line listing the keys, before Orbax reads anything.
  changed = _set(copy.deepcopy(config), model__d_model=64, model__attention="castle")
  with pytest.raises(ConfigMismatchError) as error:
    train(changed)
  message = str(error.value)
  assert "\n" not in message
  assert "model.d_model: 32 -> 64" in message and "model.attention: 'mha' -> 'castle'" in message
  with pytest.raises(ValueError, match="Unknown attention 'flash'"):
    train(_set(copy.deepcopy(config), model__attention="flash"))
  # Extending the run would rebuild the LR schedule: explicit only.
  with pytest.raises(ValueError, match="train.steps: 4 -> 8.*allow_schedule_change=True"):
    train(_set(copy.deepcopy(config), train__steps=8))
  # resume=False would mix two runs.
  with pytest.raises(WorkdirNotEmptyError, match="train.resume=False.*new --workdir.*train.overwrite=True"):
    train(_set(copy.deepcopy(config), train__resume=False))
  assert open(config_path).read() == saved
  assert os.path.getmtime(os.path.join(config.workdir, "checkpoints", "4")) == checkpoint_mtime
  assert load_trained_model(config.workdir)[3] == 4  # still loadable

  _set(config, train__resume=False, train__overwrite=True, train__steps=2)
  train(config)
  aside = [p for p in os.listdir(tmp_path) if p.startswith("run.old-")]
  assert len(aside) == 1
  old = os.path.join(tmp_path, aside[0])
  assert sorted(os.listdir(os.path.join(old, "checkpoints"))) == ["4"]  # nothing deleted
  assert open(os.path.join(old, "config.json")).read() == saved
  assert _losses(old) == first_losses
  assert sorted(_losses(config.workdir)) == [1, 2]  # the new run's metrics only
  assert load_trained_model(config.workdir)[3] == 2


def test_a_locked_workdir_is_refused_at_once_and_a_stale_lock_is_taken_over(config):
  os.makedirs(config.workdir)
  with WorkdirLock(config.workdir):
    start = time.perf_counter()
    with pytest.raises(WorkdirBusyError, match=f"in use by pid {os.getpid()} on host .*another --workdir"):
      train(config)
    assert time.perf_counter() - start < 30
  assert not os.path.exists(os.path.join(config.workdir, ".lock"))  # released

  # A lock file left by a process that died (the kernel dropped its flock).
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  with open(os.path.join(config.workdir, ".lock"), "w") as f:
    json.dump({"pid": dead.pid, "host": os.uname().nodename, "started": "earlier"}, f)
  with pytest.warns(UserWarning, match=f"stale lock .* pid {dead.pid}.*no longer running"):
    lock = WorkdirLock(config.workdir).acquire()
  assert json.load(open(lock.path))["pid"] == os.getpid()
  lock.release()


def test_bpe_workdir_is_self_contained_and_zero_means_none(config, tmp_path, monkeypatch):
  pytest.importorskip("tokenizers")
  from castle_jax.data.tokenizer import train_bpe_tokenizer

  corpus = ["def f(x):\n    return x + 1\n" * 20, "class A:\n    pass\n" * 20]
  original = tmp_path / "elsewhere" / "tok.json"
  train_bpe_tokenizer(corpus, vocab_size=300, path=str(original))
  # Also: eval_batches=0 is no evaluation (not a fake loss), checkpoint_every=0 only the last step.
  _set(
    config,
    data__tokenizer=str(original),
    train__steps=2,
    train__eval_batches=0,
    train__eval_every=0,
    train__checkpoint_every=0,
  )
  result = train(config)
  assert result.last_eval_metrics == {}
  assert read_metrics(os.path.join(config.workdir, "metrics.jsonl"), split="eval") == {}
  assert sorted(os.listdir(os.path.join(config.workdir, "checkpoints"))) == ["2"]
  saved = json.load(open(os.path.join(config.workdir, "config.json")))
  assert saved["data"]["tokenizer"] == "tokenizer.json"
  original.unlink()
  monkeypatch.chdir(tmp_path)
  _, _, tokenizer, step = load_trained_model(config.workdir)
  assert step == 2 and tokenizer.path == os.path.join(config.workdir, "tokenizer.json")


# --- checkpoint integrity ------------------------------------------------------------------------


def _small_state(value):
  noise = jax.random.normal(jax.random.key(value), (64, 64))  # incompressible: a real data file
  return TrainState(
    step=jnp.int32(value),
    params={"w": noise.at[0, 0].set(value), "b": jnp.zeros(64)},
    opt_state=({"mu": jnp.ones(64)},),
  )


def _abstract(state):
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def _largest_data_file(step_dir):
  """The largest array-data file of the step's train state (Orbax's OCDBT data files)."""
  data = os.path.join(step_dir, "state", "ocdbt.process_0", "d")
  return max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)


def _flip(path):
  with open(path, "r+b") as f:
    data = bytearray(f.read())
    for i in range(min(len(data), 4096)):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(data)


def _truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)


def _saved_checkpoints(directory, steps=(2, 4)):
  checkpointer = Checkpointer(directory)
  for step in steps:
    checkpointer.save(step, _small_state(step))
  checkpointer.close()
  for step in steps:
    assert os.path.exists(os.path.join(directory, str(step), MANIFEST_NAME))
  return Checkpointer(directory)


@pytest.mark.parametrize("damage", [_flip, _truncate, os.remove])
def test_damaged_latest_step_falls_back_to_the_newest_good_one(tmp_path, damage):
  directory = str(tmp_path / "checkpoints")
  checkpointer = _saved_checkpoints(directory)
  bad_file = _largest_data_file(os.path.join(directory, "4"))
  damage(bad_file)
  assert os.path.relpath(bad_file, os.path.join(directory, "4")) in checkpointer.verify(4)
  lines = []
  state, step, damaged = checkpointer.restore_good(_abstract(_small_state(0)), log=lines.append)
  assert step == 2 and float(state.params["w"][0, 0]) == 2.0
  assert [s for s, _ in damaged] == [4]
  assert lines[0].startswith("ERROR: Checkpoint step 4") and bad_file in lines[0] and "\n" not in lines[0]
  assert any("RESUMING FROM THE OLDER STEP 2" in line for line in lines)
  # The damaged step is kept, moved aside, so that step 4 can be saved again.
  assert checkpointer.all_steps() == [2]
  assert any(name.startswith("4.damaged") for name in os.listdir(tmp_path / "checkpoints_set_aside"))
  checkpointer.close()


def test_resume_step_picks_a_step_and_all_bad_is_a_clear_error(tmp_path):
  directory = str(tmp_path / "checkpoints")
  checkpointer = _saved_checkpoints(directory, steps=(2, 4, 6))
  abstract = _abstract(_small_state(0))
  with pytest.raises(CheckpointError, match=r"resume_step=5: there is no checkpoint.*\[2, 4, 6\]"):
    checkpointer.restore_good(abstract, step=5)
  state, step, _ = checkpointer.restore_good(abstract, step=4, log=lambda _: None)
  assert step == 4 and int(state.step) == 4
  assert checkpointer.all_steps() == [2, 4]  # step 6 moved aside, kept
  for step in (2, 4):
    os.remove(_largest_data_file(os.path.join(directory, str(step))))
  with pytest.raises(CheckpointError, match=r"No usable checkpoint .* every step \(4, 2\) is damaged") as error:
    checkpointer.restore_good(abstract, log=lambda _: None)
  assert "\n" not in str(error.value)
  with pytest.raises(CheckpointError, match="Checkpoint step 4 .* is damaged: file .* is missing"):
    checkpointer.restore_good(abstract, step=4, log=lambda _: None)
  checkpointer.close()


def test_params_are_restored_without_the_optimizer_state(tmp_path):
  directory = str(tmp_path / "checkpoints")
  _saved_checkpoints(directory).close()
  checkpointer = Checkpointer(directory, read_only=True)
  params = checkpointer.restore_params(4, _abstract(_small_state(0)).params)
  checkpointer.close()
  assert set(params) == {"w", "b"} and float(params["w"][0, 0]) == 4.0


# Orbax leaves the other reads of the step as coroutines that fail when collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unverified_step_that_orbax_cannot_read_is_a_clean_error(tmp_path):
  directory = str(tmp_path / "checkpoints")
  checkpointer = _saved_checkpoints(directory)
  os.remove(os.path.join(directory, "4", MANIFEST_NAME))  # e.g. killed before the manifest was written
  _truncate(_largest_data_file(os.path.join(directory, "4")))
  with pytest.raises(CheckpointError, match="Checkpoint step 4 .* cannot be restored: ") as error:
    checkpointer.restore(4, _abstract(_small_state(0)))
  assert error.value.__cause__ is not None
  checkpointer.close()
  del error
  gc.collect()  # here, not in a later test


def test_run_resumes_from_the_last_good_checkpoint_with_the_same_loss_curve(config, finished_tiny_run, capfd):
  shutil.copytree(finished_tiny_run.config.workdir, config.workdir)  # a finished run: checkpoints 4 and 8
  _set(config, train__eval_batches=finished_tiny_run.config.train.eval_batches)
  expected = finished_tiny_run.losses
  _flip(_largest_data_file(os.path.join(config.workdir, "checkpoints", "8")))
  with pytest.raises(Interrupt):  # resumes from 4: the first step it runs is 5
    train(config, after_step=lambda step: (_ for _ in ()).throw(Interrupt()) if step == 5 else None)
  err = capfd.readouterr().err
  assert "ERROR: Checkpoint step 8" in err and "does not match its checksum" in err
  assert "RESUMING FROM THE OLDER STEP 4" in err
  train(config)
  assert _losses(config.workdir) == expected  # bit for bit
  aside = os.listdir(os.path.join(config.workdir, "checkpoints_set_aside"))
  assert len(aside) == 1 and aside[0].startswith("8.damaged")


@pytest.mark.slow
def test_resume_step_retrains_from_an_earlier_step(config):
  train(config)  # checkpoints 4 and 8
  expected = _losses(config.workdir)
  _set(config, train__resume_step=4)
  train(config)  # explicitly from step 4; step 8 is moved aside, not lost
  assert _losses(config.workdir) == expected
  aside = os.listdir(os.path.join(config.workdir, "checkpoints_set_aside"))
  assert len(aside) == 1 and aside[0].startswith("8.after-resume-step")


# --- signals and flushing ------------------------------------------------------------------------


def test_tensorboard_events_are_flushed_at_every_write(tmp_path):
  writer = MetricsWriter(str(tmp_path))
  try:
    writer.write(1, "train", {"loss": 1.0})
    events = [os.path.join(tmp_path, "tensorboard", f) for f in os.listdir(tmp_path / "tensorboard")]
    size = os.path.getsize(events[0])
    writer.write(2, "train", {"loss": 0.5})
    assert size > 0 and os.path.getsize(events[0]) > size  # on disk before close()
  finally:
    writer.close()


def _tensorboard_events(directory):
  """Every Event in the TFRecord files of `directory`."""
  from tensorboardX.proto.event_pb2 import Event

  events = []
  for name in sorted(os.listdir(directory)):
    data = open(os.path.join(directory, name), "rb").read()
    offset = 0
    while offset < len(data):
      length = int.from_bytes(data[offset : offset + 8], "little")
      events.append(Event.FromString(data[offset + 12 : offset + 12 + length]))
      offset += 12 + length + 4
  return events


def test_a_resumed_writer_sets_aside_the_records_it_logs_again(tmp_path):
  writer = MetricsWriter(str(tmp_path))
  for step in range(1, 6):
    writer.write(step, "train", {"loss": float(step)})
  writer.write(4, "eval", {"loss": 4.5})
  writer.close()
  writer = MetricsWriter(str(tmp_path), first_step=4)  # resumed from the checkpoint of step 3
  writer.write(4, "train", {"loss": 40.0})
  writer.close()
  steps = [(r["split"], r["step"], r["loss"]) for r in map(json.loads, open(tmp_path / "metrics.jsonl"))]
  assert steps == [("train", 1, 1.0), ("train", 2, 2.0), ("train", 3, 3.0), ("train", 4, 40.0)]
  aside = [(r["split"], r["step"]) for r in map(json.loads, open(tmp_path / "metrics_set_aside.jsonl"))]
  assert aside == [("train", 4), ("train", 5), ("eval", 4)]
  # TensorBoard: a restart marker at step 4 hides the first run's events from step 4 on.
  starts = [e.step for e in _tensorboard_events(tmp_path / "tensorboard") if e.HasField("session_log")]
  assert starts == [4]


def _start_training(config, steps, *extra_flags, own_process_group=False):
  overrides = [f"--config.{k}={v}" for k, v in SETTINGS.items()] + list(extra_flags)
  command = [
    sys.executable,
    "-m",
    "train",
    "--config=configs/tiny.py",
    f"--workdir={config.workdir}",
    *overrides,
    f"--config.data.data_dir={config.data.data_dir}",
    f"--config.train.steps={steps}",
  ]
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.Popen(
    command,
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    start_new_session=own_process_group,
  )


def _interrupt_after_a_few_steps(config, signum, *extra_flags, whole_group=False):
  process = _start_training(config, 10_000, *extra_flags, own_process_group=whole_group)
  metrics = os.path.join(config.workdir, "metrics.jsonl")
  deadline = time.time() + 120
  while time.time() < deadline and process.poll() is None:
    if os.path.exists(metrics) and len(open(metrics).readlines()) >= 3:
      break
    time.sleep(0.2)
  if whole_group:  # as Ctrl-C in a terminal, `timeout` or a cluster scheduler do: data workers too
    os.killpg(process.pid, signum)
  else:
    process.send_signal(signum)
  out, err = process.communicate(timeout=120)
  return process.returncode, out, err


@pytest.mark.parametrize(
  "signum, code, data_workers",
  [
    (signal.SIGINT, 130, 1),  # to the whole process group, grain's worker processes included
    pytest.param(signal.SIGTERM, 143, 0, marks=pytest.mark.slow),
  ],
)
def test_a_signal_saves_a_checkpoint_and_exits_cleanly(config, signum, code, data_workers):
  returncode, out, err = _interrupt_after_a_few_steps(
    config, signum, f"--config.data.worker_count={data_workers}", whole_group=data_workers > 0
  )
  last_line = err.strip().splitlines()[-1]
  assert returncode == code, err[-3000:]
  assert "Fatal Python error" not in err and "can't create new thread" not in err
  assert last_line.startswith(f"Stopped by {signal.Signals(signum).name} after step"), last_line
  saved = int(last_line.split("after step ")[1].split(" ")[0])
  assert f"saved checkpoint {os.path.join(config.workdir, 'checkpoints', str(saved))}." in last_line
  assert sorted(os.listdir(os.path.join(config.workdir, "checkpoints"))) == [str(saved)]
  assert os.path.exists(os.path.join(config.workdir, "checkpoints", str(saved), MANIFEST_NAME))
  assert max(_losses(config.workdir)) == saved
  tensorboard = os.path.join(config.workdir, "tensorboard")
  assert all(os.path.getsize(os.path.join(tensorboard, f)) > 0 for f in os.listdir(tensorboard))
  assert not os.path.exists(os.path.join(config.workdir, ".lock"))

  # The same command resumes from the saved step; another number of data workers cannot.
  _set(config, train__steps=10_000, data__worker_count=data_workers + 1)
  with pytest.raises(ValueError, match=rf"data.worker_count {data_workers} -> {data_workers + 1}: .* restores with"):
    train(config)
  _set(config, data__worker_count=data_workers)
  started = []
  with pytest.raises(Interrupt):
    train(config, after_step=lambda step: (started.append(step), (_ for _ in ()).throw(Interrupt()))[1])
  assert started == [saved + 1]


def test_sigterm_during_evaluation_abandons_it_saves_and_exits_promptly(config):
  """As `timeout` stops a run: SIGTERM to the trainer, then to its process group (its grain
  worker too), while two vmapped seeds evaluate after step 3. The evaluation (100,000 batches)
  is abandoned: each seed saves step 3 within seconds, with one message, and no eval record."""
  process = _start_training(
    config,
    10_000,
    "--config.train.seeds=2",
    "--config.data.worker_count=1",
    "--config.train.eval_every=3",
    "--config.train.eval_batches=100000",
    "--config.train.checkpoint_every=0",
    own_process_group=True,
  )
  metrics = os.path.join(config.workdir, "seed_1", "metrics.jsonl")
  deadline = time.time() + 120
  while time.time() < deadline and process.poll() is None:
    # One line a step (train.log_every=1): step 3's record is written just before its evaluation.
    if os.path.exists(metrics) and open(metrics).read().count("\n") >= 3:
      break
    time.sleep(0.1)
  time.sleep(1.0)  # well into the evaluation
  assert process.poll() is None, process.communicate()[1][-3000:]
  signaled = time.time()
  process.send_signal(signal.SIGTERM)
  os.killpg(process.pid, signal.SIGTERM)
  try:
    _, err = process.communicate(timeout=60)
  finally:
    if process.poll() is None:  # still evaluating: what `timeout -k` would then kill
      os.killpg(process.pid, signal.SIGKILL)
      process.communicate()
  seconds = time.time() - signaled
  assert process.returncode == 143, err[-3000:]
  assert seconds < 20, seconds
  assert err.count("SIGTERM received") == 1, err[-3000:]
  last_line = err.strip().splitlines()[-1]
  assert last_line.startswith(
    "Stopped by SIGTERM after step 3 (the signal came during step 3; its evaluation was abandoned); saved checkpoint"
  ), last_line
  for k in (0, 1):
    seed_dir = os.path.join(config.workdir, f"seed_{k}")
    assert os.listdir(os.path.join(seed_dir, "checkpoints")) == ["3"]
    assert verify_step(os.path.join(seed_dir, "checkpoints", "3")) is None
    assert read_metrics(os.path.join(seed_dir, "metrics.jsonl"), split="eval") == {}
    assert max(_losses(seed_dir)) == 3


def test_a_stop_signal_delivered_twice_is_one_request(capfd):
  """`timeout` signals the process and then its process group: one request, one message; a
  SIGINT sent that way does not abort, a second Ctrl-C later does."""
  handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  stops = StopSignals()
  with stops:
    for _ in range(2):
      os.kill(os.getpid(), signal.SIGTERM)
    assert stops.requested == signal.SIGTERM
  assert capfd.readouterr().err.count("SIGTERM received") == 1
  stops = StopSignals()
  with stops:
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    assert stops.requested == signal.SIGINT
    stops.REPEAT_S = 0.0
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


@pytest.mark.slow
def test_stop_signal_in_process_raises_training_interrupted(config):
  def send_sigterm(step):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(TrainingInterrupted, match="SIGTERM after step 3") as error:
    train(config, after_step=send_sigterm)
  assert error.value.exit_code == 143
  checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), read_only=True)
  assert checkpointer.all_steps() == [3]  # the step the signal arrived after, nothing later
  checkpointer.close()


class DeviceProgress:
  """The steps the device has finished, seen from a thread that waits on each step's
  metrics in order: what the run really did, whatever the loop believes."""

  def __init__(self, monkeypatch):
    self.finished = 0
    self._queue = queue.Queue()
    make_step = trainer.jit_train_step

    def watched(**kwargs):
      step_fn, steps = make_step(**kwargs), itertools.count(1)

      def step(state, batch):
        state, metrics = step_fn(state, batch)
        self._queue.put((next(steps), metrics["loss"]))
        return state, metrics

      return step

    monkeypatch.setattr(trainer, "jit_train_step", watched)
    self._thread = threading.Thread(target=self._watch, daemon=True)

  def _watch(self):
    while (item := self._queue.get()) is not None:
      step, loss = item
      loss.block_until_ready()
      self.finished = step
      if self.on_finished is not None:
        self.on_finished(step)

  def start(self, on_finished):
    self.on_finished = on_finished
    self._thread.start()

  def stop(self):
    self._queue.put(None)
    self._thread.join(timeout=60)


def test_a_signal_stops_the_run_within_a_step_whatever_log_every(config, monkeypatch):
  """Device steps long next to the host's work, no log step for 10,000 steps: the host
  could queue hundreds of steps ahead. The signal comes as step 3 finishes on the device;
  the run saves the step in flight (4), or the next one if the signal loses the race with
  the loop's check, never one the device reached later."""
  _set(
    config,
    model__d_model=128,
    model__n_layers=2,
    model__n_heads=4,
    data__seq_len=128,
    data__batch_size=16,
    train__steps=10_000,
    train__log_every=10_000,
    train__checkpoint_every=0,
    train__eval_every=0,
  )
  progress = DeviceProgress(monkeypatch)
  sent = {}

  def signal_after_step_3(step):
    if step == 3:
      sent["finished"] = progress.finished
      os.kill(os.getpid(), signal.SIGINT)

  progress.start(signal_after_step_3)
  try:
    with pytest.raises(TrainingInterrupted) as error:
      train(config)
  finally:
    progress.stop()
  saved = error.value.step
  steps_after_the_signal = saved - sent["finished"]
  assert 1 <= steps_after_the_signal <= 2, (saved, sent)
  # The loop's own account: the signal came during step 4 (or 3, if the signal beat the loop's
  # note that step 3 had finished), and it saved that step or the next one.
  during = error.value.signaled_during
  assert during in (3, 4) and saved - during <= 1 and error.value.exit_code == 130
  assert progress.finished == saved  # nothing ran past the saved step
  checkpointer = Checkpointer(os.path.join(config.workdir, "checkpoints"), read_only=True)
  assert checkpointer.all_steps() == [saved]
  checkpointer.close()
  assert str(error.value).startswith(f"Stopped by SIGINT after step {saved} (the signal came during step {during}); ")


def test_a_save_orbax_would_skip_is_an_error(tmp_path):
  checkpointer = _saved_checkpoints(str(tmp_path / "checkpoints"))
  with pytest.raises(CheckpointError, match=r"step 3 was not written: .* already holds steps \[2, 4\]"):
    checkpointer.save(3, _small_state(3))
  checkpointer.close()


@pytest.mark.parametrize("keep", [1, 2])
def test_every_kept_step_gets_a_manifest(tmp_path, keep):
  directory = str(tmp_path / "checkpoints")
  checkpointer = Checkpointer(directory, keep=keep)
  for step in range(1, 6):
    checkpointer.save(step, _small_state(step))
  checkpointer.close()
  kept = sorted(int(name) for name in os.listdir(directory))
  assert kept == list(range(6 - keep, 6))
  for step in kept:
    assert verify_step(os.path.join(directory, str(step))) is None
    assert os.path.exists(os.path.join(directory, str(step), MANIFEST_NAME))


def test_model_check_names_changed_keys_and_accepts_keys_added_later_at_their_default(tmp_path):
  from train.config import base_config
  from train.resume_checks import check_model_unchanged

  config = base_config()
  saved = json.loads(config.to_json_best_effort())
  del saved["model"]["sliding_window"]  # as if the run predates this key
  os.makedirs(tmp_path / "run")
  with open(tmp_path / "run" / "config.json", "w") as f:
    json.dump(saved, f)
  check_model_unchanged(str(tmp_path / "run"), config.model)  # the default: unchanged
  config.model.sliding_window, config.model.n_layers = 64, 6
  with pytest.raises(ConfigMismatchError, match=r"model.n_layers: 4 -> 6; model.sliding_window: 0 -> 64"):
    check_model_unchanged(str(tmp_path / "run"), config.model)


def test_model_check_lets_a_run_continue_on_another_implementation(tmp_path):
  """The attention kernel and rematerialization compute the same function of the same
  parameters: a resume may change them, and still not the model."""
  from train.config import base_config
  from train.resume_checks import check_model_unchanged

  config = base_config()
  os.makedirs(tmp_path / "run")
  with open(tmp_path / "run" / "config.json", "w") as f:
    f.write(config.to_json_best_effort())
  config.model.attention_impl, config.model.remat, config.model.remat_policy = "xla", True, "save_attention"
  check_model_unchanged(str(tmp_path / "run"), config.model)
  config.model.n_heads = 8
  with pytest.raises(ConfigMismatchError, match=r"^[^;]*model.n_heads: 4 -> 8\)"):
    check_model_unchanged(str(tmp_path / "run"), config.model)
