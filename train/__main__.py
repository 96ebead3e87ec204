"""`python -m train --config=configs/tiny.py --workdir=runs/tiny [--config.key=value ...]`"""

from absl import app, flags, logging
from ml_collections import config_flags

from train.config import finalize
from train.trainer import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (overrides config.workdir).")
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # keep library INFO chatter out of the progress output
  config = _CONFIG.value
  if _WORKDIR.value:
    with config.unlocked():
      config.workdir = _WORKDIR.value
  train(finalize(config))


if __name__ == "__main__":
  app.run(main)
