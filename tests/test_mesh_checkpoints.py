"""Checkpoints move across mesh shapes: saved on data x fsdp x tensor = 2x2x2 (8 fake
CPU devices), restored by Orbax into the shardings of 8x1x1, 1x8x1 or one device, the
run continues with the loss curve of the uninterrupted 2x2x2 run."""

import copy
import os
import shutil

import jax
import numpy as np
import pytest

from helpers import TINY_RUN_SETTINGS
from train.metrics import read_metrics
from train.trainer import train

# Its module-scoped fixture is costly (the 2x2x2 run every case resumes): one worker runs the
# whole module under `--dist loadgroup`, so it is trained once.
pytestmark = pytest.mark.xdist_group("test_mesh_checkpoints")

STEPS = TINY_RUN_SETTINGS["train.steps"]
SAVED = TINY_RUN_SETTINGS["train.checkpoint_every"]  # the checkpoint resumed from


def _with(config, workdir, data, fsdp, tensor, num_devices=-1, **train_keys):
  c = copy.deepcopy(config)
  with c.unlocked():
    c.workdir = workdir
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.num_devices = data, fsdp, tensor, num_devices
    for key, value in train_keys.items():
      c.train[key] = value
  return c


def _losses(workdir):
  return {s: r["loss"] for s, r in read_metrics(os.path.join(workdir, "metrics.jsonl")).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, stdlib_data_dir):
  """The 2x2x2 run of STEPS steps (checkpoints at SAVED and STEPS): (config, workdir, losses)."""
  from configs import tiny

  base = tiny.get_config()
  with base.unlocked():
    base.data.data_dir = stdlib_data_dir
    for key, value in TINY_RUN_SETTINGS.items():
      section, name = key.split(".")
      base[section][name] = value
  workdir = str(tmp_path_factory.mktemp("mesh_ckpt") / "2x2x2")
  result = train(_with(base, workdir, 2, 2, 2))
  params = result.state.params["block_0"]["attention"]["query"]["kernel"]
  assert params.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)  # really 2x2x2
  return base, workdir, _losses(workdir)


@pytest.mark.parametrize("data, fsdp, tensor, num_devices", [(8, 1, 1, -1), (1, 8, 1, -1), (1, 1, 1, 1)])
def test_resume_on_another_mesh_continues_the_loss_curve(uninterrupted, tmp_path, data, fsdp, tensor, num_devices):
  assert jax.device_count() == 8
  base, source, expected = uninterrupted
  workdir = str(tmp_path / f"{data}x{fsdp}x{tensor}")
  shutil.copytree(source, workdir)
  # Resume from step SAVED (newer steps are moved aside) on the new mesh.
  result = train(_with(base, workdir, data, fsdp, tensor, num_devices, resume_step=SAVED))
  resumed = _losses(workdir)
  assert sorted(resumed) == list(range(1, STEPS + 1))
  for step in range(1, SAVED + 1):
    assert resumed[step] == expected[step]  # the records of the first run, kept
  np.testing.assert_allclose(
    [resumed[s] for s in range(SAVED + 1, STEPS + 1)], [expected[s] for s in range(SAVED + 1, STEPS + 1)], rtol=1e-5
  )
  kernel = result.state.params["block_0"]["attention"]["query"]["kernel"]
  assert len(kernel.sharding.device_set) == (1 if num_devices == 1 else 8)
  assert kernel.addressable_shards[0].data.shape[0] == kernel.shape[0] // fsdp


def test_num_devices_outside_the_machine_is_named():
  import ml_collections
  from train.mesh import make_mesh

  with pytest.raises(ValueError, match=r"mesh.num_devices=9 must be -1 \(all\) or in 1..8"):
    make_mesh(ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1, num_devices=9)))
  assert make_mesh(ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, num_devices=2))).shape["data"] == 2
