"""Baseline-M of the CASTLE paper (Table 3): standard causal multi-head attention."""

from train.config import finalize
from train.presets import paper_config


def get_config():
  return finalize(paper_config("m"))
