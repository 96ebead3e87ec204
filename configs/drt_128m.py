"""DRT-128M of the GCA paper (Hu et al., App. A): the decoder of the 16K-context runs.

12 layers (6 lower, 6 upper in G=1 retrieval group), d_model 768, 12 heads x 64, SwiGLU
2048, ALiBi self-attention over a 512-position window, a 2-layer chunk encoder, k = 8
retrieved chunks of S = 63 tokens + a landmark (64 positions, the authors' pre-training
layout), on 16,380-token windows (260 chunks). Recipe as stated in App. A: AdamW
(0.9, 0.95), weight decay 0.001, peak LR 2e-3, 2% warm-up, cosine to 4e-4, clip 1.0,
bf16, 2^19-token batches (32 x 16,380), 60K steps (~31B tokens). The paper uses GPT-2's
tokenizer (vocabulary padded to 50304 here); with the default byte tokenizer most
embedding rows go unused: point data.tokenizer at a trained BPE to use them. The data is
the embedded python_stdlib corpus by default (the paper: PG19 / arXiv-math).

Parameters (castle_jax.models.count_parameters, tied embeddings): 146,011,392, of
which 38,633,472 are the embedding table (107,377,920 without it); the SWA baseline
`swa_128m` has 123,587,328 ("128M" is the paper's name for this size class).

The batch of 32 sequences is reached by 8 accumulation steps of 4 (the paper's batch
per A100); on N GPUs set --config.train.grad_accum_steps=8/N.
"""

from train.config import base_config, finalize
from train.presets import PAPER_VOCAB_SIZE

SEQ_LEN = 16380  # 260 chunks of 63 tokens (the spec's "random 16,380-token windows")
CHUNK_SIZE = 63
WINDOW = 512
BATCH = 32  # x 16,380 tokens ~ 2^19


def paper_128m_config():
  """Widths, data and optimizer shared by the 128M DRT models and their SWA baseline
  (model.family "transformer", ALiBi over the window; the DRT files set the family)."""
  c = base_config()
  m = c.model
  m.vocab_size = PAPER_VOCAB_SIZE
  m.n_layers, m.d_model, m.n_heads, m.head_dim, m.mlp_hidden = 12, 768, 12, 64, 2048
  m.sliding_window = WINDOW
  m.attention_kwargs = dict(positions="alibi")
  m.tie_embeddings = True
  m.dtype = "bfloat16"
  m.remat = True
  c.data.seq_len = SEQ_LEN
  c.data.batch_size = BATCH
  t = c.train
  t.steps = 60_000
  t.grad_accum_steps = 8
  t.learning_rate = 2e-3
  t.min_lr_ratio = 4e-4 / 2e-3
  t.warmup_steps = 1200  # 2% of the run
  t.b1, t.b2 = 0.9, 0.95
  t.weight_decay = 0.001
  t.grad_clip = 1.0
  t.log_every = 50
  t.eval_every = 1000
  t.eval_batches = 16
  t.checkpoint_every = 1000
  return c


def drt_128m_config(retrieval_groups: int = 1):
  c = paper_128m_config()
  c.model.family = "drt"
  c.model.family_kwargs = dict(chunk_size=CHUNK_SIZE, top_k=8, retrieval_groups=retrieval_groups, encoder_layers=2)
  return c


def get_config():
  return finalize(drt_128m_config(retrieval_groups=1))
