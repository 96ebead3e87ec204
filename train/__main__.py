"""`python -m train --config=configs/tiny.py --workdir=runs/tiny [--config.key=value ...]`

`python -m train --config_help` lists every config key with its default.
A multi-process job (several hosts, or one process per GPU) is N copies of this
command with `--coordinator_address=HOST:PORT --num_processes=N --process_id=I`
(or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID); under SLURM
(`srun`) or Open MPI (`mpirun`) no flag is needed (train/distributed.py).
`--config.train.seeds=N` trains seeds 0..N-1 of the config, seed k in WORKDIR/seed_<k>/
(docs/training.md#several-seeds).
Exit status: 0 done, 1 a clear error (one line; `--traceback` shows the trace),
130 after SIGINT (Ctrl-C) and 143 after SIGTERM, each once a checkpoint of the
step in flight is saved.
"""

import sys

from absl import flags, logging
from ml_collections import config_flags

from castle_jax.command_line import UsageError, exit_with_error, run_absl
from train.command_line import HELP_FLAGS, config_flags_parser, workdir_problem

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (overrides config.workdir).")
_CONFIG_HELP = flags.DEFINE_bool("config_help", False, "Print every config key with its default and exit.")
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "Multi-process job: HOST:PORT of process 0 (default $JAX_COORDINATOR_ADDRESS)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "Multi-process job: number of processes (default $JAX_NUM_PROCESSES).", lower_bound=1
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "Multi-process job: this process's id in 0..N-1 (default $JAX_PROCESS_ID).", lower_bound=0
)
_COORDINATOR_TIMEOUT = flags.DEFINE_integer(
  "coordinator_timeout_s", 300, "Multi-process job: seconds to wait for every process to join.", lower_bound=1
)


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # keep library INFO chatter out of the progress output
  config = _CONFIG.value
  workdir = _WORKDIR.value or config.get("workdir")
  if not workdir:
    raise UsageError("--workdir is required: pass --workdir=DIR (checkpoints and metrics go there), e.g. runs/tiny")
  problem = workdir_problem(workdir)
  if problem:
    raise UsageError(problem)
  with config.unlocked():
    config.workdir = workdir
  # Imported once the arguments are known to be usable: jax and the model take seconds.
  from train.config import finalize
  from train.distributed import DistributedInitError, initialize_if_launched
  from train.signals import TrainingInterrupted
  from train.trainer import ERRORS_WITH_A_FIX, train

  try:
    initialize_if_launched(
      _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, initialization_timeout=_COORDINATOR_TIMEOUT.value
    )  # before any device use
    train(finalize(config))
  except TrainingInterrupted as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(e.exit_code)
  except (*ERRORS_WITH_A_FIX, DistributedInitError) as e:
    exit_with_error(e)


def run():
  arguments = sys.argv[1:]
  for argument in arguments:
    if argument == "--seeds" or argument.startswith("--seeds="):
      count = argument.partition("=")[2] or "N"
      exit_with_error(
        UsageError(f"{argument}: the number of seeds is a config key: pass --config.train.seeds={count}"), arguments
      )
  if "--config_help" in arguments:  # before flag parsing, which requires --config
    from train.config_help import config_help_text

    print(config_help_text())
    sys.exit(0)
  if any(a in HELP_FLAGS for a in arguments):  # `--help` prints the module docstring: with the keys
    from train.config_help import config_help_text

    sys.modules["__main__"].__doc__ = f"{__doc__}\n{config_help_text()}\n"
  run_absl(main, flags_parser=config_flags_parser)


if __name__ == "__main__":
  run()
