"""Passkey fine-tuning of `drt_tiny` (the paper fine-tunes its pre-trained models on
synthetic passkey prompts, App. D).

The model is drt_tiny's, unchanged, so a finished drt_tiny run can be the starting
point: `python -m train --config=configs/drt_tiny_passkey.py --workdir=runs/drt_tiny_passkey
--config.train.init_from=runs/drt_tiny`. Without init_from it trains from scratch.

Data: passkey prompts of 1,024 tokens (1,023 inputs) over haystacks of the embedded
corpus, needle at a uniform random depth, so it is usually far outside the 64-position
window; the loss is on the 5 passkey digits only; the question is padded so that the
answer " is <passkey>" starts a 31-token chunk (as the paper places the landmark before
"is"). `swa_tiny_passkey` sees the same batches.
"""

from configs.drt_tiny import get_config as drt_tiny_config


def get_config():
  c = drt_tiny_config()
  passkey_fine_tuning(c, align_to=c.model.family_kwargs.chunk_size)
  return c


def passkey_fine_tuning(c, *, align_to: int):
  """Passkey data and a fine-tuning schedule, on a tiny config (in place)."""
  c.data.task = "passkey"
  c.data.passkey.loss = "answer"
  c.data.passkey.digits = 5
  c.data.passkey.align_to = align_to
  c.data.batch_size = 8
  t = c.train
  t.steps = 400
  t.learning_rate = 1e-3
  t.warmup_steps = 20
  t.log_every = 20
  t.eval_every = 100
  t.eval_batches = 4
  t.checkpoint_every = 100
