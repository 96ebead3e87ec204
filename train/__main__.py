"""`python -m train --config=configs/tiny.py --workdir=runs/tiny [--config.key=value ...]`

`python -m train --config_help` lists every config key with its default.
A multi-process job (several hosts, or one process per GPU) is N copies of this
command with `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`
(or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); under SLURM
(`srun`) or Open MPI (`mpirun`) no flag is needed (train/distributed.py).
Exit status: 0 done, 1 a clear error (one line; `--traceback` shows the trace),
130 after SIGINT (Ctrl-C) and 143 after SIGTERM, each once a checkpoint of the
last finished step is saved.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from train.checkpointing import CheckpointError
from train.config import finalize
from train.config_help import config_help_text
from train.distributed import DistributedInitError, initialize_if_launched
from train.signals import TrainingInterrupted
from train.trainer import TrainingDivergedError, train
from train.workdir import ConfigMismatchError, WorkdirBusyError, WorkdirNotEmptyError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (overrides config.workdir).")
_CONFIG_HELP = flags.DEFINE_bool("config_help", False, "Print every config key with its default and exit.")
_TRACEBACK = flags.DEFINE_bool("traceback", False, "Show the full traceback of an error instead of one line.")
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "Multi-process job: HOST:PORT of process 0 (default $JAX_COORDINATOR_ADDRESS)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "Multi-process job: number of processes (default $JAX_NUM_PROCESSES)."
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "Multi-process job: this process's id in 0..N-1 (default $JAX_PROCESS_ID)."
)
_COORDINATOR_TIMEOUT = flags.DEFINE_integer(
  "coordinator_timeout_s", 300, "Multi-process job: seconds to wait for every process to join."
)

# Errors whose message says what to change: shown as one line.
_CLEAR_ERRORS = (
  ValueError,
  FileNotFoundError,
  CheckpointError,
  ConfigMismatchError,
  WorkdirBusyError,
  WorkdirNotEmptyError,
  TrainingDivergedError,
  DistributedInitError,
)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # keep library INFO chatter out of the progress output
  config = _CONFIG.value
  if _WORKDIR.value:
    with config.unlocked():
      config.workdir = _WORKDIR.value
  try:
    initialize_if_launched(
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, initialization_timeout=_COORDINATOR_TIMEOUT.value
    )  # before any device use
    train(finalize(config))
  except TrainingInterrupted as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
  except _CLEAR_ERRORS as e:
    if _TRACEBACK.value:
      raise
    print(f"ERROR: {e}", file=sys.stderr, flush=True)
    sys.exit(1)


# `--help` prints this module's docstring first: make it list the config keys too.
__doc__ = f"{__doc__}\n{config_help_text()}\n"


def _parse_flags(argv):
  """absl's flag parsing, with a misspelled --config.<key> override as one line.

  ml_collections applies the overrides while parsing and raises a bare
  AttributeError/KeyError for a key the config does not have.
  """
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError) as e:
    overrides = [a.split("=")[0] for a in argv[1:] if a.startswith("--config.")]
    key = str(e).strip("\"'")
    print(
      f"ERROR: unknown config key '{key}' in {' '.join(overrides)}; `python -m train --config_help` lists every key",
      file=sys.stderr,
      flush=True,
    )
    sys.exit(1)


def run():
  if "--config_help" in sys.argv[1:]:  # before flag parsing, which requires --config
    print(config_help_text())
    sys.exit(0)
  app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
  run()
