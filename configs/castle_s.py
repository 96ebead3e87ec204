"""CASTLE-S of the CASTLE paper (Table 3): causal attention with lookahead keys."""

from train.config import finalize
from train.presets import castle_paper_config


def get_config():
  return finalize(castle_paper_config("s"))
