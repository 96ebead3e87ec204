"""A small DRT trained from scratch on passkey prompts on one GPU, to test retrieval far
past the training length (`benchmarks/drt_passkey.sh`: train for a time budget, then
passkey accuracy from 2K to 1M tokens with the chunk memory in host RAM).

d_model 256, 8 layers (4 lower, 4 upper, one retrieval group), 4 heads of 64, a 2-layer
chunk encoder, chunks of 63 tokens + a landmark, k = 4, ALiBi window 128 positions;
byte tokens; 2,047-token passkey prompts (the needle is almost always outside the
window), loss on the passkey digits only, bfloat16. About 8M parameters.
"""

from configs.drt_tiny import get_config as drt_tiny_config
from configs.drt_tiny_passkey import passkey_fine_tuning


def get_config():
  c = drt_tiny_config()
  c.model.d_model = 256
  c.model.n_layers = 8
  c.model.n_heads = 4
  c.model.dtype = "bfloat16"
  c.model.sliding_window = 128
  c.model.family_kwargs = dict(chunk_size=63, top_k=4, retrieval_groups=1, encoder_layers=2)
  c.data.seq_len = 2047
  passkey_fine_tuning(c, align_to=63)
  c.data.batch_size = 32
  t = c.train
  t.steps = 3000
  t.learning_rate = 1e-3
  t.warmup_steps = 100
  t.log_every = 50
  t.eval_every = 500
  t.checkpoint_every = 250
  return c
