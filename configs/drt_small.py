"""A small DRT for one GPU: language-model pre-training before the passkey fine-tune
(`configs/drt_small_passkey.py`, `benchmarks/drt_passkey.sh`).

The spec's "DRT-tiny" widths: d_model 384, 6 heads x 64, 4 lower + 4 upper layers in
one retrieval group, a 2-layer chunk encoder, chunks of 63 tokens + a landmark, k = 8
retrieved chunks, an ALiBi self-attention window of 64 positions (the spec: 512); byte tokens,
16,380-token windows (260 chunks), bf16, AdamW as `drt_128m` (lr 2e-3, cosine to 1/5).
About 19M parameters.

Why the small window: eight stacked windows reach 8 x W positions back, and whatever
they reach the model learns to use without retrieval. With W = 512 (reach 4,096) a
passkey fine-tune on 2K-token prompts taught the windows, not the retriever: the
answers were right only with the needle within ~1,400 tokens (benchmarks/RESULTS.md).
With W = 64 (reach 512) most of every training window, and most passkey distances,
are reachable by retrieval alone, which is what a few minutes of one GPU can teach.

The paper fine-tunes *pre-trained* models on passkey prompts: a model trained from
scratch on the passkey digits alone stays at chance (benchmarks/RESULTS.md), because
nothing has taught its cross attention to copy or its retriever to match content.
Source code is good pre-training for both: identifiers defined far back are used
again, beyond the window, and only retrieval reaches them.
"""

from train.config import base_config, finalize

CHUNK_SIZE = 63


def get_config():
  c = base_config()
  m = c.model
  m.family = "drt"
  m.d_model, m.n_layers, m.n_heads, m.head_dim = 384, 8, 6, 64
  m.sliding_window = 64
  m.attention_kwargs = dict(positions="alibi")
  m.family_kwargs = dict(chunk_size=CHUNK_SIZE, top_k=8, retrieval_groups=1, encoder_layers=2)
  m.dtype = "bfloat16"
  c.data.seq_len = 16380
  c.data.batch_size = 4
  t = c.train
  t.steps = 2000
  t.learning_rate = 2e-3
  t.min_lr_ratio = 0.2
  t.warmup_steps = 100
  t.b1, t.b2 = 0.9, 0.95
  t.weight_decay = 0.001
  t.log_every = 50
  t.eval_every = 500
  t.eval_batches = 8
  t.checkpoint_every = 250
  return finalize(c)
