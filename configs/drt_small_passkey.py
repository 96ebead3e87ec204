"""Passkey fine-tuning of `drt_small` (the paper's recipe, App. D: pre-train, then
fine-tune on synthetic passkey prompts), for `benchmarks/drt_passkey.sh`:

    python -m train --config=configs/drt_small_passkey.py --workdir=runs/drt_small_passkey \
        --config.train.init_from=runs/drt_small

Prompts of 320 to 2,047 tokens (uniform), needle at a uniform depth, the answer
" is <passkey>" aligned to start a chunk, loss on the 5 passkey digits only. Most
needles lie beyond what the stacked 64-position windows reach (8 layers: 512 positions),
so only retrieval finds them. Short prompts have few chunks, so the needle's chunk is
almost always among the k = 8 retrieved ones and the cross attention learns to copy from
it; long ones teach the retriever to find it among up to 33. Evaluation goes far past
that (4K to 16M tokens). Without init_from it trains from scratch, which
does not learn the task at this budget.
"""

from configs.drt_small import CHUNK_SIZE
from configs.drt_small import get_config as drt_small_config


def get_config():
  # drt_small's model and AdamW settings; passkey data and a fine-tuning schedule.
  c = drt_small_config()
  d = c.data
  d.task = "passkey"
  d.seq_len = 2047
  d.batch_size = 32
  d.passkey.loss = "answer"
  d.passkey.digits = 5
  d.passkey.align_to = CHUNK_SIZE
  d.passkey.min_length = 320
  t = c.train
  t.steps = 1500
  t.learning_rate = 1e-3
  t.min_lr_ratio = 0.1
  t.warmup_steps = 50
  t.log_every = 25
  t.eval_every = 500
  t.eval_batches = 4
  t.checkpoint_every = 500
  return c
