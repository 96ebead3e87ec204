"""CASTLE-SWL-S of the CASTLE paper (Table 3): lookahead keys over a sliding window."""

from train.config import finalize
from train.presets import castle_paper_config


def get_config():
  return finalize(castle_paper_config("s", swl=True))
