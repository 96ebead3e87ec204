#!/usr/bin/env bash
# LongSpec's anchor-offset claim (paper Sec. 3.2, Table 2) over several seeds on one GPU: does a
# draft trained on short samples with anchor-offset positions ([0..3, 4 + o, ...], o ~ U{0..
# max_offset}) accept more tokens per round on prompts longer than its samples than the same draft
# trained with plain positions (max_offset = 0)?
#   1. one target (configs/longspec_target_tiny.py), or TARGET=<a trained target's workdir>;
#   2. the draft's short-sample stage (configs/longspec_draft_tiny.py: 128-token samples, offsets
#      up to 384 so that positions reach the target's 512) in two arms, "anchor" (the config) and
#      "no_anchor" (max_offset=0), SEEDS seeds each. Seed k of both arms starts from the same
#      parameters and reads the same batches (train.seeds' pairing). A draft trains against a
#      frozen target, which the vmapped seeds step does not take, so each (arm, seed) is its own
#      process (`train.seeds_mode=sequential` with `train.seed_indices=k`), all at once on the GPU;
#   3. `python -m benchmarks.longspec` at T = 0 (greedy, float32 so that the output must equal the
#      target's own) on held-out files: tau (tokens per target forward) of every (arm, seed) at
#      each of LENGTHS, one process per length, the longest first;
#   4. a summary: tau per seed and arm, and anchor - no_anchor paired by seed (mean, 95% t interval,
#      paired t test; castle_jax.eval.compare's statistics) per length, beside the stage's eval
#      loss compared by castle_jax.eval.compare (plain positions, 128 tokens: not the claim).
# Positions beyond the no-anchor draft's training samples start at LENGTHS' first value (448 +
# 64 new tokens reach 512); the second (64 + 64 = 128) stays inside them: the control, where the
# arms should not differ.
#
#   OUT=results bash benchmarks/longspec_anchor_seeds.sh [--config.key=value ... (every training run)]
#       one GPU, about 9 minutes: DEADLINE=540 s from the start (target TARGET_SECONDS=170, drafts
#       DRAFT_SECONDS=170, the rest for the evaluation); with TARGET= the drafts get the target's time
#   SMOKE=1 OUT=/tmp/anchor_smoke bash benchmarks/longspec_anchor_seeds.sh
#       any machine (CPU): 2 seeds, 3 steps per run, short prompts; checks the plumbing only
#
# Settings (environment): PYTHON (python3), OUT (receives longspec_anchor_seeds.tar.gz and a copy of
# summary.txt; must not hold them yet), RUNS (checkpoints; default a new folder under /tmp, not
# archived), SEEDS (4), TARGET (a trained target's workdir: no target training), TARGET_CONFIG,
# DRAFT_CONFIG (the tiny pair), TARGET_STEPS (5000), DRAFT_STEPS (2500), LENGTHS (448,64),
# NEW_TOKENS (64), PROMPTS (timed batches per length: 4), BATCH (prompts per batch: 8), TREE
# (4,16,16,16,16), MEM_FRACTION (each draft process's share of the GPU memory: 0.09), EVAL_RESERVE
# (seconds kept for the evaluation and the summary: 150). Where the GPU command's own limit also
# covers installing packages, lower DEADLINE by their time. The python_stdlib corpus is built before
# the drafts start; with TARGET and another corpus (--config.data.*) build that one first.
# A run still going at its time limit gets SIGTERM, saves the step in flight and stops; the summary
# lists every seed's last step and says when the arms stopped at different steps.
set -u
start=$SECONDS
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # kept valid after the cd below
SMOKE=${SMOKE:-0}
OUT=$(realpath -m "${OUT:-runs/longspec_anchor_seeds}")
[ -n "${TARGET:-}" ] && TARGET=$(realpath -m "$TARGET")
cd "$(dirname "$0")/.." || exit 1  # the repository root: python -m train, configs/, benchmarks/
RUNS=${RUNS:-}
TARGET_CONFIG=${TARGET_CONFIG:-configs/longspec_target_tiny.py}
DRAFT_CONFIG=${DRAFT_CONFIG:-configs/longspec_draft_tiny.py}
TREE=${TREE:-4,16,16,16,16}
MEM_FRACTION=${MEM_FRACTION:-0.09}
ARMS="anchor no_anchor"  # the first is the base of the differences' sign: anchor - no_anchor
if [ "$SMOKE" = 1 ]; then
  SEEDS=${SEEDS:-2}
  DEADLINE=${DEADLINE:-1500} TARGET_SECONDS=${TARGET_SECONDS:-400} DRAFT_SECONDS=${DRAFT_SECONDS:-600}
  TARGET_STEPS=${TARGET_STEPS:-3} DRAFT_STEPS=${DRAFT_STEPS:-3}
  LENGTHS=${LENGTHS:-192,32} NEW_TOKENS=${NEW_TOKENS:-16} PROMPTS=${PROMPTS:-1} BATCH=${BATCH:-2}
  target_size=(--config.data.batch_size=2 --config.train.eval_batches=1 --config.train.log_every=1)
  draft_size=(--config.data.batch_size=2 --config.train.eval_batches=1 --config.train.log_every=1)
  every=3
else
  SEEDS=${SEEDS:-4}
  DEADLINE=${DEADLINE:-540} TARGET_SECONDS=${TARGET_SECONDS:-170} DRAFT_SECONDS=${DRAFT_SECONDS:-170}
  TARGET_STEPS=${TARGET_STEPS:-5000} DRAFT_STEPS=${DRAFT_STEPS:-2500}
  LENGTHS=${LENGTHS:-448,64} NEW_TOKENS=${NEW_TOKENS:-64} PROMPTS=${PROMPTS:-4} BATCH=${BATCH:-8}
  # The tiny configs are float32 for CPUs; on a GPU their step is launch-bound either way.
  target_size=() draft_size=()
  every=100  # checkpoints (kept) for a step common to every draft, should the time limit stop them
fi
EVAL_RESERVE=${EVAL_RESERVE:-150}  # kept for the evaluation whatever training takes
[ -n "${TARGET:-}" ] && DRAFT_SECONDS=$((DRAFT_SECONDS + TARGET_SECONDS))
[[ $SEEDS =~ ^[0-9]+$ ]] && [ "$SEEDS" -ge 2 ] || { echo "ERROR: SEEDS=$SEEDS: a paired comparison needs >= 2" >&2; exit 2; }
if [ -e "$OUT/longspec_anchor_seeds.tar.gz" ] || [ -e "$OUT/summary.txt" ]; then
  echo "ERROR: OUT=$OUT holds the results of an earlier run (never replaced); pass a new OUT" >&2
  exit 2
fi
[ -n "$RUNS" ] || RUNS=$(mktemp -d /tmp/longspec_anchor_runs.XXXXXX)
RUNS=$(realpath -m "$RUNS")
for arm in $ARMS; do
  [ -e "$RUNS/$arm" ] && { echo "ERROR: $RUNS/$arm exists (a previous run): pass another RUNS" >&2; exit 2; }
done
STAGE=$(mktemp -d /tmp/longspec_anchor_out.XXXXXX)  # what the archive holds, as longspec_anchor_seeds/
RESULTS=$STAGE/longspec_anchor_seeds
LOGS=$RESULTS/logs
mkdir -p "$OUT" "$LOGS" "$RUNS"
say() { echo "[$((SECONDS - start))s] $*" | tee -a "$RESULTS/summary.txt"; }
left() { echo $((DEADLINE - (SECONDS - start) - $1)); }  # seconds until the deadline, less a reserve
limit() { local rest; rest=$(left "$2"); echo $(($1 < rest ? $1 : rest)); }  # own limit, capped by the deadline
archive() {  # the device returns few files: everything in one archive, summary.txt beside it
  [ -e "$OUT/longspec_anchor_seeds.tar.gz" ] && return
  tar -czf "$OUT/longspec_anchor_seeds.tar.gz" -C "$STAGE" longspec_anchor_seeds && cp "$RESULTS/summary.txt" "$OUT/summary.txt"
  echo "wrote $OUT/longspec_anchor_seeds.tar.gz ($(du -h "$OUT/longspec_anchor_seeds.tar.gz" | cut -f1)); checkpoints in $RUNS"
}
# An outer time limit or Ctrl-C still leaves the archive of what was reached.
trap 'say "stopped by a signal"; archive; exit 143' TERM INT

{
  echo "start: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "commit: $(git rev-parse HEAD 2> /dev/null || echo unknown)"
  echo "python: $("$PY" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())' 2>&1 | tail -n 1)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2> /dev/null || echo "no nvidia-smi"
  echo "SMOKE=$SMOKE SEEDS=$SEEDS TARGET=${TARGET:-trained here} TARGET_CONFIG=$TARGET_CONFIG DRAFT_CONFIG=$DRAFT_CONFIG"
  echo "TARGET_STEPS=$TARGET_STEPS DRAFT_STEPS=$DRAFT_STEPS DEADLINE=$DEADLINE TARGET_SECONDS=$TARGET_SECONDS DRAFT_SECONDS=$DRAFT_SECONDS"
  echo "LENGTHS=$LENGTHS NEW_TOKENS=$NEW_TOKENS PROMPTS=$PROMPTS BATCH=$BATCH TREE=$TREE extra flags: $*"
  echo "RUNS=$RUNS"
} > "$LOGS/environment.txt"
say "environment: $(tr '\n' ' ' < "$LOGS/environment.txt")"

stopped() {  # name status: one line on how a training process ended
  local what
  case $2 in 0) what="finished" ;; 124 | 143) what="stopped at its time limit after saving" ;; 137) what="killed after its time limit" ;; *) what="FAILED" ;; esac
  say "$1: exit status $2 ($what); last line: $(grep -v '^\s*$' "$LOGS/$1.log" | tail -n 1)"
}

# 1. The target (one for every arm and seed), or the one given.
if [ -z "${TARGET:-}" ]; then
  TARGET=$RUNS/target
  seconds=$(limit "$TARGET_SECONDS" $((EVAL_RESERVE + 60)))
  say "training the target, at most ${seconds}s"
  timeout -s TERM -k 20 "$seconds" "$PY" -m train --config="$TARGET_CONFIG" --workdir="$TARGET" \
    --config.train.steps="$TARGET_STEPS" --config.train.eval_every="$every" --config.train.checkpoint_every="$every" \
    --config.train.progress_bar=False "${target_size[@]}" "$@" > "$LOGS/target.log" 2>&1
  stopped target $?
  mkdir -p "$RESULTS/target" && cp "$TARGET/config.json" "$TARGET/metrics.jsonl" "$RESULTS/target/" 2> /dev/null
fi
if ! ls "$TARGET"/checkpoints/[0-9]* > /dev/null 2>&1; then
  say "ERROR: the target $TARGET has no checkpoint (logs/target.log)"
  archive
  exit 1
else
  # The draft processes start together: the corpus is built once before them (the target's
  # training built it already, unless TARGET was given on a fresh machine).
  timeout -s TERM 120 "$PY" -c "from castle_jax.data.pipeline import get_builder; get_builder('python_stdlib')" \
    > "$LOGS/data.log" 2>&1 || say "WARNING: building the python_stdlib corpus failed (logs/data.log)"
fi

# 2. Both arms' drafts, every seed its own process, all at once (a tiny draft leaves the GPU idle).
seconds=$(limit "$DRAFT_SECONDS" "$EVAL_RESERVE")
say "training arms '$ARMS' x $SEEDS seeds against $TARGET, at most ${seconds}s"
declare -A pids
for arm in $ARMS; do
  arm_flags=()
  [ "$arm" = no_anchor ] && arm_flags=(--config.model.family_kwargs.max_offset=0)
  for k in $(seq 0 $((SEEDS - 1))); do
    XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION timeout -s TERM -k 20 "$seconds" "$PY" -m train \
      --config="$DRAFT_CONFIG" --workdir="$RUNS/$arm" --config.model.family_kwargs.target_workdir="$TARGET" \
      --config.train.seeds="$SEEDS" --config.train.seeds_mode=sequential --config.train.seed_indices="$k" \
      --config.train.steps="$DRAFT_STEPS" --config.train.eval_every="$every" --config.train.checkpoint_every="$every" \
      --config.train.keep_checkpoints=100 --config.train.progress_bar=False "${arm_flags[@]}" "${draft_size[@]}" "$@" > "$LOGS/${arm}_seed$k.log" 2>&1 &
    pids[$arm.$k]=$!
  done
done
drafts=() seed_dirs=()
for arm in $ARMS; do
  for k in $(seq 0 $((SEEDS - 1))); do
    wait "${pids[$arm.$k]}"
    stopped "${arm}_seed$k" $?
    seed_dir=$RUNS/$arm/seed_$k
    mkdir -p "$RESULTS/$arm/seed_$k"
    cp "$RUNS/$arm/seeds.json" "$RESULTS/$arm/" 2> /dev/null
    cp "$seed_dir/config.json" "$seed_dir/metrics.jsonl" "$RESULTS/$arm/seed_$k/" 2> /dev/null
    if ls "$seed_dir"/checkpoints/[0-9]* > /dev/null 2>&1; then
      drafts+=(--draft="${arm}_seed$k=$seed_dir") seed_dirs+=("$seed_dir")
    fi
  done
done
# Seeds stopped by the time limit stop at different steps: every draft is evaluated at the
# newest checkpoint step all of them hold, so that each pair compares equal training.
common=
[ ${#seed_dirs[@]} -gt 0 ] && common=$(JAX_PLATFORMS=cpu "$PY" -m castle_jax.eval.common_step "${seed_dirs[@]}" 2> "$LOGS/common_step.log")
step_flag=()
if [ -n "$common" ]; then
  step_flag=(--draft_step="$common")
  say "evaluating every draft at step $common, the newest checkpoint every draft holds"
elif [ ${#seed_dirs[@]} -gt 0 ]; then
  say "WARNING: no checkpoint step common to every draft: each is evaluated at its newest ($(tail -1 "$LOGS/common_step.log"))"
fi

# 3. tau of every draft, one process per prompt length (each loads the target and every draft).
if [ ${#drafts[@]} = 0 ]; then
  say "ERROR: no draft has a checkpoint (logs/*_seed*.log)"
else
  seconds=$(left 25)
  say "evaluating ${#drafts[@]} drafts at prompt lengths $LENGTHS, at most ${seconds}s"
  evals=()
  for length in $(echo "$LENGTHS" | tr , ' '); do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout -s TERM -k 10 "$seconds" "$PY" -m benchmarks.longspec \
      --target_workdir="$TARGET" "${drafts[@]}" "${step_flag[@]}" --prompt_lengths="$length" --new_tokens="$NEW_TOKENS" \
      --prompts="$PROMPTS" --batch_sizes="$BATCH" --temperatures=0 --tree="$TREE" --tree_attention=xla \
      --dtype=float32 --out="$RESULTS/tau_$length.json" > "$LOGS/tau_$length.log" 2>&1 &
    evals+=("$length:$!")
  done
  for pair in "${evals[@]}"; do
    wait "${pair#*:}"
    say "tau at ${pair%%:*}: exit status $? (logs/tau_${pair%%:*}.log; a row per draft as it finishes)"
  done
fi

# 4. Summary: tau paired by seed; the stage's eval loss by castle_jax.eval.compare (CPU, metrics only).
JAX_PLATFORMS=cpu timeout -s TERM 60 "$PY" -m castle_jax.eval.compare "$RUNS/anchor" "$RUNS/no_anchor" \
  --output="$RESULTS/compare" > "$LOGS/compare.log" 2>&1
say "compare (draft eval loss, plain positions): exit status $? (logs/compare.log)"
JAX_PLATFORMS=cpu "$PY" - "$RESULTS" "$SEEDS" "$LENGTHS" $ARMS << 'EOF' 2>&1 | tee -a "$RESULTS/summary.txt"
import json
import os
import sys

from castle_jax.eval.compare import describe_difference, mean_interval, paired_difference

results, seeds, lengths, arms = sys.argv[1], int(sys.argv[2]), [int(n) for n in sys.argv[3].split(",")], sys.argv[4:]
base, other = arms  # anchor, no_anchor: differences are base - other


def rows(length):
  """The benchmark's rows at `length`: its --out file, else the rows its log printed before a time limit."""
  path = os.path.join(results, f"tau_{length}.json")
  if os.path.exists(path):
    return json.load(open(path))
  found = []
  log = os.path.join(results, "logs", f"tau_{length}.log")
  for line in open(log) if os.path.exists(log) else []:
    if line.startswith("{"):
      found.append(json.loads(line))
  return found


def last_step(arm, seed):
  path = os.path.join(results, arm, f"seed_{seed}", "metrics.jsonl")
  records = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
  train = [r["step"] for r in records if r.get("split") == "train"]
  evals = [r for r in records if r.get("split") == "eval"]
  return max(train, default=0), (evals[-1]["loss"] if evals else None)


tau = {}  # (arm, seed, length) -> tau
identical = {}
evaluated_step = {}
for length in lengths:
  for row in rows(length):
    arm, _, seed = row["draft"].rpartition("_seed")
    tau[(arm, int(seed), length)] = row["tau"]
    identical[(arm, int(seed), length)] = row["identical_to_autoregressive"]
    evaluated_step[(arm, int(seed))] = row["draft_step"]
summary = {"seeds": seeds, "lengths": lengths, "per_seed": {}, "arms": {}, "anchor_minus_no_anchor": {}}
print("tau (tokens per target forward, T = 0) per seed at the step evaluated; the draft's last step and eval loss")
steps = {}
for arm in arms:
  for seed in range(seeds):
    steps[(arm, seed)], loss = last_step(arm, seed)
    cells = "  ".join(f"{n}: {tau[(arm, seed, n)]:.3f}" if (arm, seed, n) in tau else f"{n}: -" for n in lengths)
    loss_text = "-" if loss is None else f"{loss:.3f}"
    at = evaluated_step.get((arm, seed), "-")
    print(
      f"  {arm:>9} seed {seed}: trained {steps[(arm, seed)]:>5} steps, eval loss {loss_text}; step {at}: tau {cells}"
    )
    summary["per_seed"][f"{arm}_seed{seed}"] = {
      "steps": steps[(arm, seed)],
      "evaluated_step": evaluated_step.get((arm, seed)),
      "eval_loss": loss,
      "tau": {str(n): tau.get((arm, seed, n)) for n in lengths},
      "identical_to_autoregressive": {str(n): identical.get((arm, seed, n)) for n in lengths},
    }
if len(set(evaluated_step.values())) > 1:
  print("  note: the drafts were evaluated at different steps; pairs compare unequal training")
if any(value is False for value in identical.values()):
  print("  WARNING: some speculative output differs from the target's greedy output (see tau_*.json)")
print(f"\n{base} - {other}, paired by seed: mean [95% t interval], paired t test p")
for length in lengths:
  per_arm = {arm: {s: tau[(arm, s, length)] for s in range(seeds) if (arm, s, length) in tau} for arm in arms}
  summary["arms"][str(length)] = {arm: mean_interval(list(v.values())) if v else None for arm, v in per_arm.items()}
  if len(set(per_arm[base]) & set(per_arm[other])) < 1:
    print(f"  prompt {length}: no pair of seeds evaluated")
    continue
  difference = paired_difference(per_arm[other], per_arm[base])  # base - other
  summary["anchor_minus_no_anchor"][str(length)] = difference
  means = "  ".join(f"{arm} {summary['arms'][str(length)][arm]['mean']:.3f}" for arm in arms)
  print(f"  prompt {length}: {describe_difference(difference)} ({difference['n']} seeds; {means})")
with open(os.path.join(results, "summary.json"), "w") as f:
  json.dump(summary, f, indent=1)
EOF
tail -n 25 "$LOGS/compare.log" >> "$RESULTS/summary.txt"
say "done"
archive
ls "$RESULTS"/tau_*.json > /dev/null 2>&1
