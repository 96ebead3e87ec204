"""Model shapes and training recipe of the CASTLE paper (Table 3, Appendix A.1.2).

Baselines mirror GPT-3 M/L/XL (S is widened); 2K context, 0.5M-token batches,
AdamW(0.9, 0.95), weight decay 0.1, clip 1.0, 2000 warm-up steps, cosine to 10%
of the peak, 50B tokens (100K steps). The vocabulary is GPT-2's padded to 50304:
with the default byte tokenizer most rows go unused, but the parameter count
matches the paper; point data.tokenizer at a trained BPE to use them.
"""

from __future__ import annotations

import math

import ml_collections

from train.config import base_config

# size -> (n_layers, d_model, baseline heads, head_dim, peak learning rate)
PAPER_SHAPES = {
  "s": (12, 896, 14, 64, 6.0e-4),
  "m": (24, 1024, 16, 64, 3.0e-4),
  "l": (24, 1536, 16, 96, 2.5e-4),
  "xl": (24, 2048, 16, 128, 2.0e-4),
}
PAPER_VOCAB_SIZE = 50304
PAPER_SEQ_LEN = 2048
PAPER_BATCH_TOKENS = 2**19  # 0.5M
PAPER_TOKENS = 50e9
# CASTLE keeps d_model and head_dim and takes ~4/7 of the heads for parameter parity;
# CASTLE-SWL slides a window over the lookahead keys (Table 3, Sec. 3.1).
CASTLE_HEADS = {"s": 8, "m": 9, "l": 9, "xl": 9}
CASTLE_SWL_WINDOWS = {"s": 128, "m": 512, "l": 512, "xl": 512}


def paper_config(
  size: str, *, attention: str = "mha", n_heads: int | None = None, micro_batch: int = 16
) -> ml_collections.ConfigDict:
  """The Table 3 configuration of one model size.

  Args:
    size: "s", "m", "l" or "xl".
    attention: registry name of the attention.
    n_heads: head count (default: the baseline's); d_model and head_dim stay fixed,
      as the paper does to match parameter counts across attentions.
    micro_batch: sequences per gradient-accumulation step; the default fits one
      80 GB GPU; the 256-sequence batch is reached by accumulation.
  """
  if size not in PAPER_SHAPES:
    raise ValueError(f"Unknown paper model size {size!r}; choose one of {sorted(PAPER_SHAPES)}")
  n_layers, d_model, baseline_heads, head_dim, learning_rate = PAPER_SHAPES[size]
  c = base_config()
  m = c.model
  m.vocab_size = PAPER_VOCAB_SIZE
  m.n_layers, m.d_model, m.head_dim = n_layers, d_model, head_dim
  m.n_heads = n_heads or baseline_heads
  m.attention = attention
  m.tie_embeddings = True  # Table 3's parameter counts include one embedding table
  m.dtype = "bfloat16"
  c.data.seq_len = PAPER_SEQ_LEN
  c.data.batch_size = PAPER_BATCH_TOKENS // PAPER_SEQ_LEN
  t = c.train
  t.grad_accum_steps = max(1, c.data.batch_size // micro_batch)
  t.learning_rate = learning_rate
  t.warmup_steps = 2000
  t.steps = int(PAPER_TOKENS // PAPER_BATCH_TOKENS)
  t.log_every = 50
  t.eval_every = 1000
  t.eval_batches = 16
  t.checkpoint_every = 1000
  return c


def castle_paper_config(size: str, *, swl: bool = False, micro_batch: int = 16) -> ml_collections.ConfigDict:
  """CASTLE-{size} (or CASTLE-SWL-{size} with `swl`) of Table 3: the baseline's recipe
  with CASTLE_HEADS[size] heads and, for SWL, lookahead window CASTLE_SWL_WINDOWS[size]."""
  c = paper_config(
    size, attention="castle_swl" if swl else "castle", n_heads=CASTLE_HEADS.get(size), micro_batch=micro_batch
  )
  if swl:
    c.model.attention_kwargs.lookahead_window = CASTLE_SWL_WINDOWS[size]
  return c


# Power attention paper (Appendix D): GPT-2 model sizes (Radford et al., 2019) with
# head size 64; context 1024, 32 sequences per batch, lr 3e-4 with 2000 warm-up steps
# from 0 and a cosine decay to 1e-5 over the run, AdamW beta=(0.9, 0.999), weight
# decay 0.1, clip 1.0, bf16, activation checkpointing (on here from size M up).
# size -> (n_layers, d_model, n_heads)
POWER_PAPER_SHAPES = {"s": (12, 768, 12), "m": (24, 1024, 16), "l": (36, 1280, 20)}
POWER_PAPER_SEQ_LEN = 1024
POWER_PAPER_BATCH = 32
POWER_PAPER_LR = 3e-4
POWER_PAPER_MIN_LR = 1e-5
# The paper trains "one epoch (or until convergence)" of LongCrawl64 and reports small
# models at iteration 64K (Fig. 8b); 64K steps is the default run length here.
POWER_PAPER_STEPS = 64_000


def power_paper_config(
  size: str = "s", *, p: int = 2, attention: str = "power", chunk_size: int | None = None, micro_batch: int = 32
) -> ml_collections.ConfigDict:
  """The power-attention paper's Appendix D setup for one GPT-2 size.

  The block stays this library's (RMSNorm, SwiGLU, RoPE): the paper, too, changes
  only the attention layer of its architectures. "MLP ratio 4" of a GELU MLP is met at
  equal parameters and FLOPs by SwiGLU of width 8/3 d_model (2048 for S, a multiple
  of 64), so S has 124M parameters like GPT-2 small.

  Args:
    size: "s", "m" or "l".
    p: the power of attention "power" (ignored for other attentions).
    attention: "power", or a baseline ("mha", with model.sliding_window for windows).
    chunk_size: tokens per chunk of the chunked form; None lets the op choose by cost (at
      the paper's 1,024-token context the Triton kernels run the attention form).
    micro_batch: sequences per gradient-accumulation step.
  """
  if size not in POWER_PAPER_SHAPES:
    raise ValueError(f"Unknown power-paper model size {size!r}; choose one of {sorted(POWER_PAPER_SHAPES)}")
  n_layers, d_model, n_heads = POWER_PAPER_SHAPES[size]
  c = base_config()
  m = c.model
  m.vocab_size = PAPER_VOCAB_SIZE
  m.n_layers, m.d_model, m.n_heads, m.head_dim = n_layers, d_model, n_heads, 64
  m.mlp_hidden = round(8 * d_model / 3 / 64) * 64
  m.attention = attention
  m.tie_embeddings = True  # as GPT-2
  m.dtype = "bfloat16"
  # The paper checkpoints activations; at S size a 32-sequence micro-batch fits one 80 GB GPU
  # without it, and recomputing each block costs ~25% of the step (model.remat=True for
  # larger sizes or batches).
  m.remat = size != "s"
  if attention == "power":
    m.attention_kwargs.p = p
    # An int placeholder: None until a command line or config sets it.
    m.attention_kwargs.chunk_size = ml_collections.config_dict.placeholder(int)
    m.attention_kwargs.chunk_size = chunk_size
  c.data.seq_len = POWER_PAPER_SEQ_LEN
  c.data.batch_size = POWER_PAPER_BATCH
  t = c.train
  t.grad_accum_steps = max(1, POWER_PAPER_BATCH // micro_batch)
  t.learning_rate = POWER_PAPER_LR
  t.min_lr_ratio = POWER_PAPER_MIN_LR / POWER_PAPER_LR
  t.warmup_steps = 2000
  t.b2 = 0.999
  t.steps = POWER_PAPER_STEPS
  t.log_every = 50
  t.eval_every = 1000
  t.eval_batches = 16
  t.checkpoint_every = 1000
  return c


# In-context-learning comparison at CPU scale (the paper's Sec. 5.1 in miniature): the
# tiny model's widths, 4096-token context, power p = 2 against full attention and
# sliding-window attention with the same decoding state. Per head, power keeps
# D (d + 1) numbers (D = C(d + 1, 2)); a window of W tokens keeps 2 W d, so the
# equal-state window is W = D (d + 1) / (2 d): 272 for d = 32. (For the paper's d = 64
# it is 1056, the paper's window-1024 pairing.)
ICL_SEQ_LEN = 4096
ICL_HEAD_DIM = 32


def equal_state_window(head_dim: int, p: int = 2) -> int:
  """The sliding window whose KV cache holds as many numbers as a power-attention state."""
  expanded = math.comb(head_dim + p - 1, p)
  return round(expanded * (head_dim + 1) / (2 * head_dim))


def icl_config(attention: str) -> ml_collections.ConfigDict:
  """The ICL-curve experiment for `attention` in ("power", "mha", "swa")."""
  if attention not in ("power", "mha", "swa"):
    raise ValueError(f"Unknown ICL attention {attention!r}; choose 'power', 'mha' or 'swa'")
  c = base_config()
  m = c.model
  m.d_model, m.n_layers, m.n_heads, m.head_dim = 128, 4, 4, ICL_HEAD_DIM
  m.dtype = "float32"  # CPU
  m.attention = "power" if attention == "power" else "mha"
  if attention == "power":
    m.attention_kwargs.p = 2
    m.attention_kwargs.chunk_size = 256
  if attention == "swa":
    m.sliding_window = equal_state_window(ICL_HEAD_DIM)
  c.data.seq_len = ICL_SEQ_LEN
  c.data.batch_size = 2
  t = c.train
  # A few CPU minutes per run (2 cores: 1,100-2,000 tokens/s for power, ~470 for softmax
  # attention at this context): 246K training tokens. Raise on a GPU.
  t.steps = 30
  t.learning_rate = 3e-3
  t.warmup_steps = 5
  t.log_every = 5
  t.eval_every = 30
  t.eval_batches = 1
  t.checkpoint_every = 30
  return c


# The same comparison at 8192-token context on one GPU (benchmarks/power_icl_seeds.sh): widths of
# `tiny` doubled (4 layers, d_model 256), heads kept at ICL_HEAD_DIM so that the equal-state window
# stays 272, bfloat16, and each attention's GPU kernel chosen explicitly (an arm that cannot run its
# kernel fails instead of silently taking a slower path): the Triton kernels for power attention
# (p = 2, gated, the chunk chosen by cost), cuDNN flash attention for full and windowed softmax.
ICL_GPU_SEQ_LEN = 8192
ICL_GPU_IMPLEMENTATIONS = {"power": "triton", "mha": "cudnn", "swa": "cudnn"}


def icl_gpu_config(attention: str) -> ml_collections.ConfigDict:
  """The ICL-curve experiment for `attention` in ("power", "mha", "swa") at 8192-token context on one GPU.

  Sized so that the three arms, with 2 or 3 vmapped seeds each (`--config.train.seeds=3`), train
  at once on one GPU within minutes: 250 steps of 4 sequences per seed (8.2M tokens per seed).
  Checkpoints every 50 steps, all kept, so that arms stopped by a time limit at different
  steps still share a checkpoint step to be compared at (`benchmarks.icl_curve --step=common`).
  """
  c = icl_config(attention)
  m = c.model
  m.d_model, m.n_heads = 256, 256 // ICL_HEAD_DIM
  m.dtype = "bfloat16"
  m.attention_impl = ICL_GPU_IMPLEMENTATIONS[attention]
  if attention == "power":
    # An int placeholder left at None: the Triton kernels pick the chunk by cost (1024 here).
    m.attention_kwargs.chunk_size = ml_collections.config_dict.placeholder(int)
  c.data.seq_len = ICL_GPU_SEQ_LEN
  c.data.batch_size = 4
  t = c.train
  t.steps = 250
  t.learning_rate = 2e-3
  t.warmup_steps = 25
  t.log_every = 25
  t.eval_every = 50
  t.eval_batches = 2
  t.checkpoint_every = 50
  t.keep_checkpoints = 20
  t.progress_bar = False
  return c
