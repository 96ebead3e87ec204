"""The second stage of `drt_tiny_retrieval`: from a run that read every chunk, fine-tune
with top-4 retrieval (and Gumbel noise) on 2,047-token prompts (64 chunks), so that the
model must pick the needle's chunk itself, as it will at evaluation.

    python -m train --config=configs/drt_tiny_retrieval.py --workdir=runs/drt_tiny_retrieval
    python -m train --config=configs/drt_tiny_retrieval_topk.py --workdir=runs/drt_tiny_retrieval_topk \
        --config.train.init_from=runs/drt_tiny_retrieval
    python -m castle_jax.eval.passkey --workdir=runs/drt_tiny_retrieval_topk \
        --lengths=2048,16384,131072,1048576 --examples=10

`top_k` and `gumbel` do not change the parameters, so `train.init_from` accepts the
first stage's run (`castle_jax.models.drt.TRAINING_ONLY_KWARGS`).
"""

from configs.drt_tiny_retrieval import get_config as drt_tiny_retrieval_config


def get_config():
  c = drt_tiny_retrieval_config()
  c.model.family_kwargs = dict(c.model.family_kwargs, top_k=4)
  c.data.seq_len = 2047
  c.data.batch_size = 16
  t = c.train
  t.steps = 5000
  t.learning_rate = 5e-4
  t.warmup_steps = 100
  t.eval_every = 1000
  t.checkpoint_every = 1000
  return c
