"""drt_tiny learning retrieval from scratch on passkey prompts, then evaluated far past
its training length with a small k.

Prompts of 512 tokens (17 chunks of 31 + a landmark), the needle usually outside the
64-position window, loss on the passkey digits only. Two choices make the retrieval path
learnable from scratch at this size (benchmarks/RESULTS.md, "Can the retrieval path learn
to copy?"): every earlier chunk is retrieved in training (top_k = 17, so the needle's chunk
is always read and its learned weight says how much), and the GCA output also enters the
residual stream (gca_output="residual"). With the authors' placement (MLP input only) or
with top-4 of 16 chunks, the same budget stays at chance.

    python -m train --config=configs/drt_tiny_retrieval.py --workdir=runs/drt_tiny_retrieval
    python -m castle_jax.eval.passkey --workdir=runs/drt_tiny_retrieval --top_k=4 \
        --lengths=2048,16384,131072,1048576 --examples=10
"""

from configs.drt_tiny_passkey import get_config as drt_tiny_passkey_config


def get_config():
  c = drt_tiny_passkey_config()
  c.model.family_kwargs = dict(chunk_size=31, top_k=17, retrieval_groups=1, encoder_layers=1, gca_output="residual")
  c.data.seq_len = 511
  c.data.batch_size = 32
  t = c.train
  t.steps = 16000
  t.learning_rate = 2e-3
  t.warmup_steps = 200
  t.log_every = 100
  t.eval_every = 2000
  t.eval_batches = 8
  t.checkpoint_every = 2000
  return c
