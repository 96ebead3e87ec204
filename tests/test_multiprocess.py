"""Multi-process training as clusters run it, on one CPU machine.

Two `python -m train` processes (4 fake CPU devices each) join one job through
`jax.distributed.initialize` (a local coordinator, gloo collectives) and train on
one 8-device mesh, each reading its own shard of the documents. Their loss curve
equals a single process on 8 devices that reads both shards itself (the same
global batch: process 0's rows, then process 1's).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest

from castle_jax.checkpoints import MANIFEST_NAME
from castle_jax.data.pipeline import make_lm_iterator
from helpers import TINY_RUN_SETTINGS
from train.distributed import DistributedInitError, job_spec
from train.metrics import read_metrics
from train.trainer import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_job(
  workdir: str, data_dir: str, processes: int = 2, devices_per_process: int = 4, extra: tuple[str, ...] = ()
) -> list[subprocess.Popen]:
  """Starts `processes` copies of `python -m train` forming one job (env-var launch)."""
  address = f"localhost:{portpicker.pick_unused_port()}"
  overrides = [f"--config.{k}={v}" for k, v in TINY_RUN_SETTINGS.items()]
  command = [
    sys.executable,
    "-m",
    "train",
    "--config=configs/tiny.py",
    f"--workdir={workdir}",
    *overrides,
    f"--config.data.data_dir={data_dir}",
    *extra,
  ]
  jobs = []
  for index in range(processes):
    env = dict(
      os.environ,
      PYTHONPATH=ROOT,
      JAX_PLATFORMS="cpu",
      JAX_COORDINATOR_ADDRESS=address,
      JAX_NUM_PROCESSES=str(processes),
      JAX_PROCESS_ID=str(index),
      XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
    )
    jobs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  return jobs


def wait_all(jobs, timeout=240) -> list[str]:
  outputs = []
  try:
    for job in jobs:
      out, err = job.communicate(timeout=timeout)
      outputs.append(out + err)
  finally:
    for job in jobs:
      if job.poll() is None:
        job.kill()
  for index, (job, text) in enumerate(zip(jobs, outputs)):
    assert job.returncode == 0, f"process {index} exited {job.returncode}:\n{text[-3000:]}"
  return outputs


class BothShards:
  """One process's iterator that reads what a 2-process job reads: every batch is
  process 0's rows followed by process 1's (the global batch of the job)."""

  def __init__(self, data_config, tokenizer, split, shuffle, prefetch=0):
    self.shards = [
      make_lm_iterator(
        data_config, tokenizer, split=split, shuffle=shuffle, process_index=i, process_count=2, prefetch=prefetch
      )
      for i in range(2)
    ]

  def __next__(self):
    parts = [next(it) for it in self.shards]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

  def get_state(self) -> bytes:
    return json.dumps([it.get_state() for it in self.shards]).encode()

  def set_state(self, state: bytes) -> None:
    for it, s in zip(self.shards, json.loads(state)):
      it.set_state(s)

  def start_prefetch(self) -> None:
    pass

  def close(self):
    for it in self.shards:
      it.close()


def _losses(workdir):
  return {s: r["loss"] for s, r in read_metrics(os.path.join(workdir, "metrics.jsonl")).items()}


def test_two_processes_train_like_one(tiny_run_config, tmp_path, monkeypatch):
  """If both processes read the same documents (or all of them), the global batches,
  and so the losses, would differ from the reference's (shard 0 rows, shard 1 rows)."""
  config = tiny_run_config
  jobs = launch_job(str(tmp_path / "job"), config.data.data_dir)

  # Meanwhile: one process, 8 devices, the same global batches.
  def both_shards(data_config, tokenizer, *, split, shuffle, prefetch=0, **_):
    return BothShards(data_config, tokenizer, split, shuffle, prefetch)

  monkeypatch.setattr("train.trainer.make_lm_iterator", both_shards)
  train(config)
  expected = _losses(config.workdir)
  outputs = wait_all(jobs)

  losses = _losses(str(tmp_path / "job"))
  steps = TINY_RUN_SETTINGS["train.steps"]
  assert sorted(losses) == list(range(1, steps + 1)), outputs[0][-2000:]
  np.testing.assert_allclose([losses[s] for s in sorted(losses)], [expected[s] for s in sorted(expected)], rtol=2e-5)
  assert losses[steps] < losses[1]
  # Each process saved its own position in its own shard of the documents.
  data_iter = tmp_path / "job" / "checkpoints" / str(steps) / "data_iter"
  saved = sorted(name for name in os.listdir(data_iter) if name.startswith("process_"))
  assert saved == ["process_0-of-2.json", "process_1-of-2.json"]
  assert not any("ERROR" in text for text in outputs)


def test_a_signal_to_one_process_stops_the_whole_job_at_one_step_within_a_few(tiny_run_config, tmp_path):
  """SIGINT to process 1 of 2 with no log step for 10,000 steps: both processes stop after
  the same step, a few steps after the one the signal interrupted, and save it together."""
  workdir = str(tmp_path / "job")
  long_run = (
    "--config.train.steps=10000",
    "--config.train.log_every=10000",
    "--config.train.checkpoint_every=0",
    "--config.train.eval_every=0",
  )
  jobs = launch_job(workdir, tiny_run_config.data.data_dir, extra=long_run)
  metrics = os.path.join(workdir, "metrics.jsonl")
  try:
    deadline = time.time() + 180
    while time.time() < deadline and all(job.poll() is None for job in jobs):
      if os.path.exists(metrics) and open(metrics).read().strip():  # step 1 is logged
        break
      time.sleep(0.2)
    time.sleep(1.0)  # a few more steps, none of them logged
    jobs[1].send_signal(signal.SIGINT)
    outputs = [job.communicate(timeout=120) for job in jobs]
  finally:
    for job in jobs:
      if job.poll() is None:
        job.kill()
  last = [err.strip().splitlines()[-1] for _, err in outputs]
  assert [job.returncode for job in jobs] == [130, 130], outputs[0][1][-2000:] + outputs[1][1][-2000:]
  saved = [int(re.search(r"after step (\d+)", line).group(1)) for line in last]
  assert saved[0] == saved[1], last
  during = int(re.search(r"the signal came during step (\d+)", last[1]).group(1))
  # After the interrupted step: the one queued behind it, and at most one more that the vote
  # (cast before each step) needs; one more if the signal beat the loop's note of a finished step.
  assert 1 <= saved[1] - during <= 3, last[1]
  assert "(sent to another process of the job)" in last[0]
  checkpoint = os.path.join(workdir, "checkpoints", str(saved[0]))
  assert os.listdir(os.path.join(workdir, "checkpoints")) == [str(saved[0])]
  assert f"saved checkpoint {checkpoint}." in last[0] and os.path.exists(os.path.join(checkpoint, MANIFEST_NAME))


def test_two_processes_read_different_documents(tiny_run_config):
  from castle_jax.data.tokenizer import load_tokenizer

  tokenizer = load_tokenizer("byte")
  first = [
    next(
      make_lm_iterator(tiny_run_config.data, tokenizer, split="train", shuffle=True, process_index=i, process_count=2)
    )["inputs"]
    for i in range(2)
  ]
  assert first[0].shape == (TINY_RUN_SETTINGS["data.batch_size"] // 2, TINY_RUN_SETTINGS["data.seq_len"])
  assert not np.array_equal(first[0], first[1])


# --- when to join a job --------------------------------------------------------------------------


def test_job_spec_from_flags_and_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "host0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
  spec = job_spec(env=env)
  assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.cluster) == ("host0:1234", 4, 2, None)
  spec = job_spec("other:99", 2, 1, env=env)  # flags win
  assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("other:99", 2, 1)
  assert job_spec(env={}) is None
  assert job_spec(env={"JAX_NUM_PROCESSES": "1"}) is None


def test_schedulers_are_detected_without_flags():
  slurm = {
    "SLURM_JOB_ID": "7",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_NTASKS": "16",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "3",
  }
  assert job_spec(env=slurm).cluster == "slurm"
  assert job_spec(env=dict(slurm, SLURM_NTASKS="1")) is None  # one task: a plain run
  ompi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
  assert job_spec(env=ompi).cluster == "ompi"


@pytest.mark.parametrize(
  "env, match",
  [
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "missing: --coordinator_address / JAX_COORDINATOR_ADDRESS"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "missing: --process_id / JAX_PROCESS_ID"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, r"outside \[0, 2\)"),
    ({"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "needs a port"),
    ({"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer"),
  ],
)
def test_incomplete_settings_are_named(env, match):
  with pytest.raises(DistributedInitError, match=match):
    job_spec(env=env)


def test_unreachable_coordinator_is_one_line(tmp_path):
  """Process 1 of a job whose process 0 never starts: a one-line error, exit 1."""
  command = [
    sys.executable,
    "-m",
    "train",
    "--config=configs/tiny.py",
    f"--workdir={tmp_path}",
    f"--coordinator_address=localhost:{portpicker.pick_unused_port()}",
    "--num_processes=2",
    "--process_id=1",
    "--coordinator_timeout_s=3",
  ]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 1, done.stderr[-2000:]
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("ERROR: Could not join the multi-process job as process 1 of 2"), done.stderr[-2000:]
