"""DRT streaming decoding (`castle_jax.models.drt_decoding.DRTStream`): prefill and
per-token speed, device and host memory, at long contexts, with the paper's 128M shape.

    python -m benchmarks.drt_decoding [--lengths=65536,1048576] [--segment_chunks=64] \
        [--decode_tokens=32] [--check_length=4096] [--dtype=bfloat16] [--json=out.json]

The model is randomly initialised (speed and memory do not depend on the weights):
12 layers (6 lower, 6 upper, G = 1), d_model 768, 12 heads of 64, chunks of S = 64 + a
landmark, k = 8, ALiBi window W = 512, 2 encoder layers. For each length: a prompt of
that many tokens is fed at once (after a warm-up stream of the same capacity, so compile
time is excluded), then `--decode_tokens` greedy tokens one at a time. Device memory:
`castle_jax.eval.passkey.device_memory()` (peak and in use, on GPU) next to the stream's own device state (window
caches, landmarks, served chunks) and the chunk memory in host RAM.

`--check_length`: the streamed logits of a prompt's last 256 tokens against the
teacher-forced forward pass (float32 weights and compute; bfloat16 reported too).
"""

from __future__ import annotations

import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from castle_jax import command_line as cl
from castle_jax.config import ModelConfig
from castle_jax.eval.passkey import device_memory
from castle_jax.models.drt import DRT, DRTOptions
from castle_jax.models.drt_decoding import DRTStream
from benchmarks.timing import run_meta, write_json

GIB = 2**30


def drt_128m(dtype: str, vocab: int) -> DRT:
  config = ModelConfig(
    family="drt",
    vocab_size=vocab,
    d_model=768,
    n_layers=12,
    n_heads=12,
    dtype=dtype,
    sliding_window=512,
    attention_kwargs=(("positions", "alibi"),),
  )
  return DRT(config, DRTOptions(chunk_size=64, top_k=8, retrieval_groups=1, encoder_layers=2))


def init_params(model: DRT):
  # The key is an argument: closed over, XLA constant-folds the whole random init (minutes).
  init = jax.jit(lambda key: model.init(key, jnp.zeros((1, 64), jnp.int32)))
  return nn.unbox(init(jax.random.key(0)))["params"]


def check_row(dtype: str, length: int, vocab: int, segment_chunks: int) -> dict:
  model = drt_128m(dtype, vocab)
  params = init_params(model)
  tokens = jax.random.randint(jax.random.key(1), (1, length), 0, vocab)
  expected = jax.jit(lambda p, t: model.apply({"params": p}, t)[0][:, -256:])(params, tokens)
  stream = DRTStream(model, params, 1, length, segment_chunks=segment_chunks)
  got = stream.feed(np.asarray(tokens), keep=256)
  return {
    "check": dtype,
    "tokens": length,
    "max_abs_diff": float(jnp.max(jnp.abs(got - expected))),
    "max_abs_logit": float(jnp.max(jnp.abs(expected))),
    "argmax_agreement": float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(expected, -1))),
  }


def speed_row(model: DRT, params, length: int, decode_tokens: int, segment_chunks: int, vocab: int) -> dict:
  capacity = length + decode_tokens
  rng = np.random.default_rng(length)
  prompt = rng.integers(0, vocab, (1, length), dtype=np.int32)
  warm = DRTStream(model, params, 1, capacity, segment_chunks=segment_chunks)
  # Two segments, a partial chunk, then single tokens through every in-chunk offset, within capacity.
  warm_tokens = max(
    1, min(length, capacity - model.options.chunk_size - 1, 2 * segment_chunks * model.options.chunk_size + 17)
  )
  logits = warm.feed(prompt[:, :warm_tokens])
  for _ in range(model.options.chunk_size + 1):  # every single-token piece shape
    logits = warm.feed(np.asarray(jnp.argmax(logits[:, -1], -1))[:, None])
  jax.block_until_ready(logits)
  del warm

  stream = DRTStream(model, params, 1, capacity, segment_chunks=segment_chunks)
  start = time.perf_counter()
  logits = jax.block_until_ready(stream.feed(prompt))
  prefill_s = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(decode_tokens):
    logits = stream.feed(np.asarray(jnp.argmax(logits[:, -1], -1))[:, None])
  jax.block_until_ready(logits)
  decode_ms = (time.perf_counter() - start) / decode_tokens * 1e3
  return {
    "tokens": length,
    "prefill_s": prefill_s,
    "prefill_tokens_per_s": length / prefill_s,
    "decode_ms_per_token": decode_ms,
    "device_state_mib": stream.device_state_bytes / 2**20,
    "landmarks_mib": stream.state.landmarks.nbytes / 2**20,
    "host_chunk_memory_gib": stream.memory.nbytes / GIB,
    **device_memory(),
  }


def main(argv) -> int:
  parser = cl.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", type=cl.positive_int_list, default="65536,1048576")
  parser.add_argument("--segment_chunks", type=cl.positive_int, default=64)
  parser.add_argument("--decode_tokens", type=cl.positive_int, default=32)
  parser.add_argument("--check_length", type=cl.nonnegative_int, default=4096, help="0: skip the check")
  parser.add_argument("--dtype", choices=cl.DTYPES, default="bfloat16")
  parser.add_argument("--vocab", type=cl.positive_int, default=32000)
  parser.add_argument("--json", type=cl.new_file, default=None, help="write the results here as JSON (a new file)")
  args = parser.parse_args(argv)
  rows = []
  if args.check_length:
    for dtype in ("float32", "bfloat16"):
      rows.append(check_row(dtype, args.check_length, args.vocab, args.segment_chunks))
      print(rows[-1], flush=True)
  model = drt_128m(args.dtype, args.vocab)
  params = init_params(model)
  for length in args.lengths:
    rows.append(speed_row(model, params, length, args.decode_tokens, args.segment_chunks, args.vocab))
    print(rows[-1], flush=True)
  write_json(args.json, {"meta": run_meta(), "args": vars(args), "rows": rows})
  print(
    f"\n{'tokens':>9} {'prefill s':>9} {'tok/s':>9} {'ms/token':>9} {'state MiB':>9} {'lmk MiB':>8} "
    f"{'host GiB':>8} {'dev peak GiB':>12}"
  )
  for r in rows:
    if "prefill_s" in r:
      print(
        f"{r['tokens']:>9} {r['prefill_s']:>9.2f} {r['prefill_tokens_per_s']:>9.0f} "
        f"{r['decode_ms_per_token']:>9.2f} {r['device_state_mib']:>9.1f} {r['landmarks_mib']:>8.1f} "
        f"{r['host_chunk_memory_gib']:>8.2f} {r.get('device_peak_gib', 0.0):>12.2f}"
      )
    else:
      print(
        f"check {r['check']} at {r['tokens']}: max |diff| {r['max_abs_diff']:.2e} "
        f"(max |logit| {r['max_abs_logit']:.2f}), argmax agreement {r['argmax_agreement']:.3f}"
      )
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
