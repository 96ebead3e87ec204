"""Passkey fine-tuning of `swa_tiny`, the baseline of `drt_tiny_passkey`: the same data
(prompts aligned to drt_tiny's 31-token chunks, so both see identical batches) and
schedule. Its 64-position window cannot reach a needle further back, so it should stay
near chance (1 in 10 per digit) on most prompts.

Start from a finished swa_tiny run with `--config.train.init_from=runs/swa_tiny`
(the model is swa_tiny's, unchanged).
"""

from configs.drt_tiny_passkey import passkey_fine_tuning
from configs.swa_tiny import get_config as swa_tiny_config

DRT_TINY_CHUNK_SIZE = 31


def get_config():
  c = swa_tiny_config()
  passkey_fine_tuning(c, align_to=DRT_TINY_CHUNK_SIZE)
  return c
