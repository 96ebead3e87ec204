"""LongSpec's cost at LLM scale: one autoregressive decoding step of a target against one
speculative round (draft a tree, verify it, commit), with random weights.

    python -m benchmarks.longspec_speed --shape=llama3_8b [--batch_sizes=1,4] \
        [--prompt_lengths=16384,32768,65536] [--taus=3.28,5.33] [--temperature=1] [--profile] [--out=longspec_speed.json]
    python -m benchmarks.longspec_speed --smoke   # tiny shapes, any device (CI)

Latency does not depend on the weights' values, so the models are random: the target a
Llama-3-8B shape (`--shape=llama3_8b`: its Hugging Face config.json through
`castle_jax.models.hf.model_config`, as an imported checkpoint gets it: 32 layers, d_model
4096, 32 query / 8 KV heads of 128, SwiGLU 14336, vocabulary 128256, RoPE theta 500000,
untied head) in bfloat16, and its one-block LongSpec draft (window 512). Their parameters
are filled on the device, leaf by leaf, with a hash of each value's index (uniform, the
config's init_std), not by the models' initializers: an 8B model never exists on the host,
and no random number generator is compiled per parameter (a compiled `model.init` holds a
threefry hash for each of the target's 291 parameters, each its own kernel for XLA).

For every batch size and prompt length, the target's KV caches hold hashed keys and values
for the prompt's positions instead of a prefill (a step's cost depends on the cache length,
not on what it holds; a prefill of a 64K prompt at batch 4 would hold chunk x capacity
float32 scores and a second copy of the caches), and the draft's ring is prefilled from the
last window of a random prompt (`_prefill_draft`, as `speculative_generate` does). Then,
prefill excluded:
  - AR step: the step that `continue_decoding` scans (one token through the target with
    its caches, then the greedy next token), jitted on its own with the caches donated so
    that they update in place;
  - round: `speculative._round`, what each iteration of `speculative_generate`'s loop runs
    (less its bookkeeping of the emitted tokens): the draft's tree, default
    [4,16,16,16,16]; one target forward verifying it with the default tree attention unless
    --tree_attention; greedy acceptance; the commit to the target's caches and the draft's
    ring. Jitted the same way.
With --temperature above 0 the step samples and the round runs the multi-candidate acceptance
instead of the greedy one (the taus to project with are then the sampling ones).
Each is called --iters times after two warm-up calls (the first compiles), each call
dispatched from Python and waited for, and the median time per call is reported, with the
fastest and slowest call beside it. With --profile, 3 more calls of each are traced and the
row records the device time per call of the 12 kernels that take the most.

The speed-up is a projection, not a measurement: tau (tokens per round, which needs trained
weights) times t_AR / t_round, for each of --taus. The defaults are the paper's tau for
LLaMA-3.1-8B-Instruct on LCC code completion at T = 0 (3.28; Yang et al., LongSpec, Table 1,
row "L-8B LongSpec") and our trained `longspec_target_s` pair's tau at 16K, T = 0, tree
[4,16,16,16,16] (5.33; benchmarks/RESULTS.md, "Speculative decoding on one H100").

Progress goes to stderr as it happens, each line with the seconds since the start: the
parameters filled, and per row the caches filled, each program's first call (its
compilation), each median and the row's JSON. A row that the device cannot hold is skipped
before it runs (the parameters and the caches against the device's memory limit, where the
device reports one), and a row that fails (e.g. out of memory) is recorded with its error;
the others go on. Prints a table last and writes every row to --out (JSON).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from castle_jax import command_line as cl
from castle_jax.eval.cli import format_table
from castle_jax.inference import speculative
from castle_jax.inference.generate import decode_token
from castle_jax.inference.sampling import sample_next_token
from castle_jax.models import build_model, count_parameters, family_of, hf, longspec_draft
from castle_jax.models.registry import abstract_params
from castle_jax.sharding import on_mesh
from castle_jax.workdir import check_mesh_fits, tensor_parallel_mesh
from castle_jax.ops.tree_attention import IMPLEMENTATIONS as TREE_ATTENTION_IMPLEMENTATIONS
from benchmarks import synthetic_step
from benchmarks.timing import error_text, run_meta, step_times, tree_bytes, write_json

GIB = 2**30
# Hugging Face config.json fields of each shape (meta-llama/Meta-Llama-3-8B's for llama3_8b).
SHAPES = {
  "llama3_8b": {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
  },
  "tiny": {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
  },
}
# tau defaults (see the module docstring): the paper's Table 1, L-8B LongSpec on LCC (T = 0),
# and RESULTS.md's longspec_target_s pair at 16K (T = 0, tree [4,16,16,16,16]).
DEFAULT_TAUS = (3.28, 5.33)
DRAFT_WINDOW = 512
PROFILED_CALLS = 3
PROFILED_OPS = 12  # the kernels recorded per program, largest first


def parse_args(argv):
  parser = cl.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3_8b", help="the target's shape")
  parser.add_argument("--batch_sizes", type=cl.positive_int_list, default=[1, 4])
  parser.add_argument(
    "--prompt_lengths", type=cl.positive_int_list, default=[16384, 32768, 65536], help="tokens in the caches"
  )
  parser.add_argument(
    "--tree", type=cl.positive_int_list, default=list(speculative.DEFAULT_TREE), help="nodes per draft level"
  )
  parser.add_argument(
    "--tree_attention",
    choices=TREE_ATTENTION_IMPLEMENTATIONS,
    default=None,
    help="the verification's tree attention (default: the op picks for the device)",
  )
  parser.add_argument(
    "--taus",
    type=cl.number_list,
    default=list(DEFAULT_TAUS),
    help="tokens per round for the projected speed-up tau * t_AR / t_round (default: the paper's "
    "Llama-3.1-8B on LCC, 3.28, and our trained small pair at 16K, 5.33)",
  )
  parser.add_argument(
    "--tensor",
    type=cl.positive_int,
    default=1,
    help="tensor-parallel degree: the target's and the draft's heads, MLP width and vocabulary, and the "
    "caches' key/value heads, split over this many devices (default 1: one device)",
  )
  parser.add_argument(
    "--temperature",
    type=float,
    default=0.0,
    help="sampling temperature of the AR step and the round (default 0: greedy; above 0 the round runs the "
    "multi-candidate acceptance and the step samples)",
  )
  parser.add_argument("--iters", type=cl.positive_int, default=20, help="timed calls per row (after 2 warm-ups)")
  parser.add_argument(
    "--profile",
    action="store_true",
    help=f"trace {PROFILED_CALLS} more calls of each program and record its GPU time by kernel, summed and the "
    "launches (row keys <program>_ops_ms, _device_ms, _kernels)",
  )
  parser.add_argument("--smoke", action="store_true", help="tiny shapes, 2 timed calls: checks the harness runs")
  parser.add_argument("--out", type=cl.new_file, default=None, help="write the rows here as JSON (a new file)")
  args = parser.parse_args(argv)
  bad = [tau for tau in args.taus if tau < 1]
  if bad:
    parser.error(f"--taus: {bad} below 1: a round emits at least one token (tau >= 1)")
  if args.temperature < 0:
    parser.error(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
  if len(args.tree) >= DRAFT_WINDOW:
    parser.error(f"--tree: depth {len(args.tree)} must be below the draft's window ({DRAFT_WINDOW})")
  if args.smoke:
    args.shape, args.batch_sizes, args.prompt_lengths, args.iters = "tiny", [2], [64], 2
  return args


def models(shape: str, mesh: jax.sharding.Mesh | None = None, progress: Callable[[str], None] | None = None):
  """(target, target params, draft, draft params): the shape's target in bfloat16 and its
  one-block LongSpec draft, their parameters hashed on the device (`_random_params`), or
  straight into their shards on `mesh` (a tensor-parallel mesh; ValueError naming --tensor
  when the heads or a width do not divide over it)."""
  progress = progress or (lambda message: None)
  config = hf.model_config(SHAPES[shape], dtype="bfloat16")
  draft_config = dataclasses.replace(config, family=longspec_draft.FAMILY, family_kwargs=(("window", DRAFT_WINDOW),))
  built = [build_model(config), build_model(draft_config)]
  params = []
  for seed, (name, model) in enumerate(zip(("target", "draft"), built)):
    progress(f"filling the {name}'s {count_parameters(model.config):,} parameters on the device")
    params.append(jax.block_until_ready(_random_params(model, seed, mesh)))
    progress(f"{name}'s parameters filled ({tree_bytes(params[-1]) / GIB:.2f} GiB)")
  return built[0], params[0], built[1], params[1]


def _hashed_uniform(shape: tuple[int, ...], dtype, seed) -> jax.Array:
  """Values uniform in [-1, 1) from a hash (lowbias32) of each element's flat index and
  `seed` (uint32): a few integer operations fused into one pass over the output, where
  `jax.random` compiles a threefry hash per call (one program filling 64 cache arrays so
  took minutes to compile on an H100). The flat index is summed from per-dimension iotas so that a sharded output is
  computed in place, shard by shard."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % 2**32)
    stride *= shape[dim]
  x = index ^ (seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B9))
  x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
  x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
  x = x ^ (x >> 16)
  return ((x >> 8).astype(jnp.float32) * 2.0**-23 - 1.0).astype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _hashed_leaf(shape, dtype, sharding, scale: float, seed):
  """`_hashed_uniform` times `scale`, computed in the shards of `sharding` when it is a
  NamedSharding (a parameter's or a cache's on a tensor-parallel mesh)."""
  x = _hashed_uniform(shape, dtype, seed) * jnp.asarray(scale, dtype)
  if isinstance(sharding, NamedSharding):
    x = jax.lax.with_sharding_constraint(x, sharding)
  return x


def _random_params(model: nn.Module, seed: int, mesh: jax.sharding.Mesh | None):
  """The model's parameters, each leaf uniform with the config's init_std, on the device
  (in their shards on `mesh`)."""
  abstract = abstract_params(model, 8, mesh=mesh)
  if mesh is not None:
    check_mesh_fits(model.config, abstract, mesh)
  # One program per distinct leaf shape (a handful), each run per leaf with its own seed:
  # one program for the whole model compiles a hash per leaf, hundreds at 32 layers.
  leaves, treedef = jax.tree.flatten(abstract)
  scale = 3**0.5 * model.config.init_std
  filled = [
    _hashed_leaf(leaf.shape, leaf.dtype, leaf.sharding, scale, np.uint32(seed * len(leaves) + i))
    for i, leaf in enumerate(leaves)
  ]
  return jax.tree.unflatten(treedef, filled)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _random_layer_cache(model, batch: int, capacity: int, mesh, seed, length):
  """One layer's cache (every layer's has the same shapes) with hashed keys and values
  (uniform in [-1, 1)) in every slot, `length` of them filled; on `mesh`, split by
  key/value heads as the model's tensor-parallel attention reads them."""
  cache = family_of(model).init_cache(model, batch, capacity)[0]
  sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec(None, None, "tensor", None))
  keys = _hashed_leaf(cache.keys.shape, cache.keys.dtype, sharding, 1.0, 2 * seed)
  values = _hashed_leaf(cache.values.shape, cache.values.dtype, sharding, 1.0, 2 * seed + 1)
  return cache.replace(keys=keys, values=values, length=length)


def _random_caches(model, batch: int, capacity: int, seed: int, length, mesh=None):
  """The model's caches with hashed keys and values in every slot (`seed` picks them),
  `length` of them filled (an int32 scalar, or [batch] for per-row lengths)."""
  # One layer's program, run once per layer: one program filling every layer's cache took
  # minutes to compile on an H100 at 8B shapes, once per row.
  layers = len(jax.eval_shape(lambda: family_of(model).init_cache(model, batch, capacity)))
  return [
    _random_layer_cache(model, batch, capacity, mesh, np.uint32(seed * layers + layer), length)
    for layer in range(layers)
  ]


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=3)
def _autoregressive_step(model, temperature: float, params, state):
  """`continue_decoding`'s step: state (caches, token int32 [batch], position int32) -> (next
  token, the next state); greedy at temperature 0, else sampled (every call from one key)."""
  caches, token, position = state
  sample = functools.partial(sample_next_token, temperature=temperature)
  next_token, caches = decode_token(model, params, caches, token, position, jax.random.key(0), sample)
  next_token = next_token.astype(jnp.int32)
  return next_token, (caches, next_token, position + 1)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), donate_argnums=7)
def _speculative_round(target, draft, shape, tree_attention, temperature, target_params, draft_params, state):
  """One round of `speculative_generate`'s loop: state (target caches, draft cache, roots
  int32 [batch], positions int32 [batch]) -> (tokens kept per row, the next state); greedy
  acceptance at temperature 0, else the multi-candidate rule (every call from one key)."""
  caches, draft_cache, root, position = state
  # No top-k or top-p filter; every row active.
  round_state = (caches, draft_cache, root, position, jnp.ones(root.shape, bool), jax.random.key(0))
  outcome, caches, draft_cache = speculative._round(
    target, draft, shape, temperature, 0, 1.0, tree_attention, target_params, draft_params, *round_state
  )
  return outcome.kept, (caches, draft_cache, outcome.bonus, position + outcome.kept)


def _profile(step, state) -> dict:
  """`kernel_times_per_call` of PROFILED_CALLS calls of `step` (its PROFILED_OPS largest kernels)."""

  def run_once():
    nonlocal state
    out, state = step(state)
    jax.block_until_ready(out)

  return synthetic_step.kernel_times_per_call(run_once, PROFILED_CALLS, PROFILED_OPS)


def needed_bytes(target, draft, batch: int, capacity: int, tensor: int = 1) -> int:
  """The parameters (bf16) and the target's caches: what a row holds on each of `tensor`
  devices (tensor parallelism splits both)."""
  config = target.config
  params = 2 * (count_parameters(config) + count_parameters(draft.config))
  caches = 2 * config.n_layers * config.kv_heads * config.qk_head_dim * capacity * batch * 2
  return (params + caches) // tensor


def _memory_limit() -> int | None:
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # not every backend reports it
    return None
  return (stats or {}).get("bytes_limit")


class Progress:
  """Prints progress lines to stderr at once, each with the seconds since it was made: at
  the 8B shape minutes can pass before the first row, and a run stopped by a timeout should
  still show how far it got."""

  def __init__(self):
    self.start = time.perf_counter()

  def __call__(self, message: str) -> None:
    print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", file=sys.stderr, flush=True)


def measure(
  args,
  target,
  target_params,
  draft,
  draft_params,
  batch: int,
  length: int,
  mesh=None,
  progress: Callable[[str], None] | None = None,
) -> dict:
  """One row: the AR step and the round at `batch` prompts of `length` tokens (on `mesh`
  with tensor parallelism, else one device); what it is doing goes to `progress`."""
  progress = progress or (lambda message: None)
  where = f"batch {batch}, prompt {length:,}:"
  shape = speculative.TreeShape(tuple(args.tree))
  # Every timed call may commit depth + 1 tokens; the Mosaic kernel takes capacities that
  # are multiples of 8.
  capacity = -(-(length + (args.iters + 2) * (shape.depth + 1)) // 256) * 256
  row = {"batch": batch, "prompt_length": length, "temperature": args.temperature, "capacity": capacity}
  needed, limit = needed_bytes(target, draft, batch, capacity, args.tensor), _memory_limit()
  row["needed_gib"] = needed / GIB
  if limit is not None and needed > limit:
    row["error"] = (
      f"skipped: needs {needed / GIB:.1f} GiB of parameters and caches per device, the device has {limit / GIB:.1f}"
    )
    return row

  def time_calls(name: str, key: str, step, state) -> None:
    """row[key + "_ms"]: the median call of `step`, row[key + "_ms_range"]: the fastest and
    slowest; row[key + "_first_call_s"]: its first call, compilation included; with
    --profile, row[key + "_ops_ms"]: device time per call by kernel, row[key + "_device_ms"]
    and row[key + "_kernels"]: every kernel's time summed and the launches, per call."""

    def first_call(seconds):
      row[f"{key}_first_call_s"] = seconds
      progress(f"{where} {name} compiled and run once in {seconds:.1f}s; timing {args.iters} calls")

    progress(f"{where} {name}: compiling (its first call)")
    times, state = step_times(step, state, (), args.iters, first_call)
    row[f"{key}_ms"] = 1e3 * statistics.median(times)
    fastest, slowest = row[f"{key}_ms_range"] = [1e3 * min(times), 1e3 * max(times)]
    progress(f"{where} {name}: {row[f'{key}_ms']:.2f} ms per call (median; {fastest:.2f}-{slowest:.2f})")
    if args.profile:
      profile = _profile(step, state)
      if not profile:
        progress(f"{where} {name}: no kernels in the trace (a CPU has none)")
      else:
        row[f"{key}_ops_ms"] = profile["ops_ms"]
        row[f"{key}_device_ms"] = profile["device_ms"]
        row[f"{key}_kernels"] = profile["kernels"]
        top = ", ".join(f"{op[:40]} {ms:.3f}" for op, ms in list(profile["ops_ms"].items())[:5])
        progress(
          f"{where} {name}: device time per call {profile['device_ms']:.2f} ms in {profile['kernels']:.0f} kernels "
          f"(wall {row[f'{key}_ms']:.2f} ms); by kernel: {top}"
        )

  try:
    prompt = jnp.asarray(
      np.random.default_rng(length).integers(0, target.config.vocab_size, (batch, length)), jnp.int32
    )
    committed = length - 1  # the prompt's last token is the first token to decode (the root)
    progress(f"{where} filling the target's caches (capacity {capacity:,})")
    caches = jax.block_until_ready(_random_caches(target, batch, capacity, 1, jnp.int32(committed), mesh))
    row["kv_cache_gib"] = tree_bytes(caches) / GIB
    progress(f"{where} caches filled ({row['kv_cache_gib']:.2f} GiB)")
    step = functools.partial(_autoregressive_step, target, args.temperature, target_params)
    time_calls("AR step", "ar_step", step, (caches, prompt[:, -1], jnp.int32(committed)))
    del caches

    lengths = np.full(batch, committed, np.int32)
    progress(f"{where} filling the target's caches again and the draft's ring")
    caches = _random_caches(target, batch, capacity, 2, jnp.asarray(lengths), mesh)
    draft_cache = speculative._prefill_draft(
      draft, draft_params, target.config, target_params, prompt[:, :-1], lengths, shape
    )
    jax.block_until_ready((caches, draft_cache))
    state = (caches, draft_cache, prompt[:, -1], jnp.asarray(lengths))
    step = functools.partial(
      _speculative_round, target, draft, shape, args.tree_attention, args.temperature, target_params, draft_params
    )
    time_calls("round", "round", step, state)
    del caches, draft_cache, state
  except Exception as e:  # one failing row (e.g. out of memory) must not lose the others
    row["error"] = error_text(e)
    return row
  row["round_over_ar_step"] = row["round_ms"] / row["ar_step_ms"]
  row["projected_speedup"] = {str(tau): tau / row["round_over_ar_step"] for tau in args.taus}
  return row


def main(argv) -> int:
  args = parse_args(argv)
  progress = Progress()
  try:
    mesh = tensor_parallel_mesh(args.tensor)
    progress(
      f"{args.shape} target and its draft on {jax.devices()[0].device_kind}"
      f"{f' x {args.tensor}, tensor parallel' if args.tensor > 1 else ''}, jax {jax.__version__}"
    )
    with on_mesh(mesh):
      built = models(args.shape, mesh, progress)
  except ValueError as e:  # a --tensor that the devices or the model's heads do not divide
    raise cl.UsageError(str(e)) from e
  target, target_params, draft, draft_params = built
  with on_mesh(mesh):
    rows = []
    for batch in args.batch_sizes:
      for length in args.prompt_lengths:
        rows.append(measure(args, target, target_params, draft, draft_params, batch, length, mesh, progress))
        progress(json.dumps(rows[-1]))
  write_json(
    args.out,
    run_meta(**{key: value for key, value in vars(args).items() if key not in ("out", "traceback")}),
    target_parameters=count_parameters(target.config),
    draft_parameters=count_parameters(draft.config),
    rows=rows,
  )
  table = []
  for r in rows:
    cells = [r["batch"], f"{r['prompt_length']:,}", f"{r['needed_gib']:.1f}"]
    if "error" in r:
      table.append(cells + [r["error"]] + [""] * (2 + len(args.taus)))
      continue
    cells += [f"{r['ar_step_ms']:.2f}", f"{r['round_ms']:.2f}", f"{r['round_over_ar_step']:.2f}"]
    table.append(cells + [f"{r['projected_speedup'][str(tau)]:.2f}x" for tau in args.taus])
  print(
    f"\n{jax.devices()[0].device_kind}{f' x {args.tensor}, tensor parallel' if args.tensor > 1 else ''}, "
    f"jax {jax.__version__}, {args.shape} target "
    f"({count_parameters(target.config):,} parameters, bfloat16) and its one-block draft, tree "
    f"{','.join(map(str, args.tree))}, tree attention {args.tree_attention or 'default'}, temperature "
    f"{args.temperature:g}, median of {args.iters} "
    "calls; speed-ups are projections tau * t_AR / t_round, not measurements"
  )
  print(
    format_table(
      ["batch", "prompt", "params+KV GiB per device", "AR step ms", "round ms", "round / AR step"]
      + [f"projection tau={tau:g}" for tau in args.taus],
      table,
    )
  )
  return 0


if __name__ == "__main__":
  sys.exit(cl.run(main))
