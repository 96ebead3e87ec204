#!/usr/bin/env bash
# Power attention's in-context-learning claim on one GPU: does gated power attention (p = 2) keep
# lowering its loss deeper into an 8192-token context, like full attention, while a sliding window
# holding as many numbers as its state stops improving? Three arms (configs/icl_{power,swa,mha}_8k.py),
# each with SEEDS vmapped seeds, train at once as separate processes sharing the GPU; then
# `benchmarks.icl_curve` evaluates every seed at the newest checkpoint step all of them hold: loss by
# position, mean and 95% interval per arm, and the gain "late - early" (mean loss over positions
# 4096-8191 minus 512-1023) per arm, with its paired difference to the power arm.
#
#   OUT=results bash benchmarks/power_icl_seeds.sh
#   SMOKE=1 OUT=/tmp/smoke bash benchmarks/power_icl_seeds.sh      # tiny shapes, XLA attention, on a CPU
#
# Settings (environment): PYTHON (python3), OUT (runs/power_icl_seeds; must not hold results yet),
# RUNS (checkpoints; default a new folder under /tmp: they are not copied to OUT), SEEDS (3), STEPS
# (the configs' 250), ARMS ("power swa mha"; the first is the base of the paired differences),
# DEADLINE (seconds after the start by which everything has ended: 510), EVAL_RESERVE (seconds kept
# for the evaluation: 110), MAX_DOCS (64), MEM_FRACTION (each training process's share of the GPU
# memory: 0.3), POWER_IMPL / SOFTMAX_IMPL (the configs' triton / cudnn; xla with SMOKE=1).
# A training run still going when its time is up gets SIGTERM, saves the step in flight and stops;
# the evaluation compares the arms at a checkpoint step every seed holds (checkpoints every 50 steps).
# Written to OUT: <arm>/seeds.json and <arm>/seed_<k>/{config.json,metrics.jsonl}, icl_curve.{json,csv,png},
# compare/ (validation loss at equal tokens, castle_jax.eval.compare), logs/, summary.txt.
set -u
start=$SECONDS
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # kept valid after the cd below
SMOKE=${SMOKE:-0}
OUT=$(realpath -m "${OUT:-runs/power_icl_seeds}")
cd "$(dirname "$0")/.." || exit 1  # the repository root: python -m train, configs/
RUNS=${RUNS:-}
SEEDS=${SEEDS:-3}
ARMS=${ARMS:-power swa mha}
MEM_FRACTION=${MEM_FRACTION:-0.3}
if [ "$SMOKE" = 1 ]; then
  DEADLINE=${DEADLINE:-900}
  EVAL_RESERVE=${EVAL_RESERVE:-240}
  MAX_DOCS=${MAX_DOCS:-4}
  POWER_IMPL=${POWER_IMPL:-xla}
  SOFTMAX_IMPL=${SOFTMAX_IMPL:-xla}
  # Tiny shapes (heads of 32 as in the real run, so the window stays the equal-state 272 and is
  # shorter than the context); float32, the CPU's fast type.
  STEPS=${STEPS:-4}
  shape=(--config.model.d_model=64 --config.model.n_heads=2 --config.model.n_layers=2 --config.model.dtype=float32
         --config.data.seq_len=512 --config.data.batch_size=2 --config.train.warmup_steps=1
         --config.train.log_every=1 --config.train.eval_batches=1)
else
  DEADLINE=${DEADLINE:-510}
  EVAL_RESERVE=${EVAL_RESERVE:-110}
  MAX_DOCS=${MAX_DOCS:-64}
  POWER_IMPL=${POWER_IMPL:-}
  SOFTMAX_IMPL=${SOFTMAX_IMPL:-}
  shape=()
fi
if [ -n "${STEPS:-}" ]; then
  # About 5 checkpoints (and evaluations) per run, as the configs' 250 steps have: few enough to
  # keep them all, so that arms stopped at different steps still hold a common one.
  every=$((STEPS / 5 > 0 ? STEPS / 5 : 1))
  shape+=(--config.train.steps="$STEPS" --config.train.checkpoint_every="$every" --config.train.eval_every="$every")
fi

for arm in $ARMS; do
  case $arm in power | swa | mha) ;; *) echo "ERROR: ARMS: unknown arm '$arm'; choose from power swa mha" >&2; exit 2 ;; esac
done
if [ -e "$OUT/icl_curve.json" ] || [ -e "$OUT/summary.txt" ] || [ -e "$OUT/logs" ]; then
  echo "ERROR: OUT=$OUT holds the results of an earlier run (never replaced); pass a new OUT" >&2
  exit 2
fi
[ -n "$RUNS" ] || RUNS=$(mktemp -d /tmp/power_icl_runs.XXXXXX)
mkdir -p "$OUT/logs" "$RUNS"
LOGS=$OUT/logs
left() { echo $((DEADLINE - (SECONDS - start) - $1)); }  # seconds until the deadline, less a margin
say() { echo "[$((SECONDS - start))s] $*" | tee -a "$OUT/summary.txt"; }

{
  echo "start: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "python: $("$PY" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__)' 2>&1)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  echo "SMOKE=$SMOKE SEEDS=$SEEDS ARMS=$ARMS STEPS=${STEPS:-config} DEADLINE=$DEADLINE EVAL_RESERVE=$EVAL_RESERVE"
  echo "MAX_DOCS=$MAX_DOCS MEM_FRACTION=$MEM_FRACTION POWER_IMPL=${POWER_IMPL:-config} SOFTMAX_IMPL=${SOFTMAX_IMPL:-config}"
  echo "RUNS=$RUNS"
} > "$LOGS/environment.txt"
say "environment: $(tr '\n' ' ' < "$LOGS/environment.txt")"

# The corpus (the Python standard library's sources), built once before the arms start.
timeout -s TERM 120 "$PY" -c "from castle_jax.data.pipeline import get_builder; get_builder('python_stdlib')" \
  > "$LOGS/data.log" 2>&1 || { say "ERROR: building the corpus failed (logs/data.log)"; tail -5 "$LOGS/data.log"; exit 1; }
say "corpus ready"

# GPU use while the arms train, every 5 s (absent on a CPU).
monitor=
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$LOGS/gpu.csv" 2>&1 &
  monitor=$!
fi

budget=$(left "$EVAL_RESERVE")
say "training arms '$ARMS' with $SEEDS seeds each, at most ${budget}s"
declare -A pids
for arm in $ARMS; do
  impl=()
  if [ "$arm" = power ] && [ -n "$POWER_IMPL" ]; then impl=(--config.model.attention_impl="$POWER_IMPL"); fi
  if [ "$arm" != power ] && [ -n "$SOFTMAX_IMPL" ]; then impl=(--config.model.attention_impl="$SOFTMAX_IMPL"); fi
  command=("$PY" -m train --config="configs/icl_${arm}_8k.py" --workdir="$RUNS/$arm" --config.train.seeds="$SEEDS"
           "${shape[@]}" "${impl[@]}")
  echo "${command[*]}" >> "$LOGS/commands.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION timeout -s TERM -k 20 "$budget" "${command[@]}" \
    > "$LOGS/train_$arm.log" 2>&1 &
  pids[$arm]=$!
done
for arm in $ARMS; do
  wait "${pids[$arm]}"
  status=$?
  case $status in 0) what="finished" ;; 124) what="stopped at the time limit" ;; 137) what="killed after the time limit" ;; *) what="FAILED" ;; esac
  say "train $arm: exit status $status ($what); last line: $(grep -v '^\s*$' "$LOGS/train_$arm.log" | tail -1)"
done
[ -n "$monitor" ] && kill "$monitor" 2> /dev/null
# Per arm, from seed 0's log: how far it got and how fast (to size the next run's STEPS).
"$PY" - "$RUNS" "$SEEDS" $ARMS << 'EOF' 2>&1 | tee -a "$OUT/summary.txt"
import json, os, sys
runs, seeds, arms = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for arm in arms:
  path = os.path.join(runs, arm, "seed_0", "metrics.jsonl")
  records = [json.loads(line) for line in open(path)] if os.path.isfile(path) else []
  logged = [r for r in records if r.get("split") == "train"]
  if not logged:
    print(f"  {arm}: no training step logged")
    continue
  first, last = logged[0], logged[-1]
  print(f"  {arm}: step {last['step']}, seed-0 train loss {last['loss']:.3f}; {seeds * last['tokens_per_sec'] / 1e3:.0f}K "
        f"tokens/s over its {seeds} seeds at the last log; step {first['step']} logged at {first['elapsed_s']:.0f} s, "
        f"step {last['step']} at {last['elapsed_s']:.0f} s of training")
EOF

# What must survive: each seed's config and metrics (the checkpoints stay in RUNS).
evaluated=()
for arm in $ARMS; do
  [ -f "$RUNS/$arm/seeds.json" ] && mkdir -p "$OUT/$arm" && cp "$RUNS/$arm/seeds.json" "$OUT/$arm/"
  complete=1
  for k in $(seq 0 $((SEEDS - 1))); do
    seed_dir=$RUNS/$arm/seed_$k
    mkdir -p "$OUT/$arm/seed_$k"
    cp "$seed_dir/config.json" "$seed_dir/metrics.jsonl" "$OUT/$arm/seed_$k/" 2> /dev/null
    steps=$(find "$seed_dir/checkpoints" -mindepth 1 -maxdepth 1 -regex '.*/[0-9]+' 2> /dev/null | wc -l)
    [ "$steps" -gt 0 ] || complete=0
  done
  if [ "$complete" = 1 ]; then evaluated+=("$RUNS/$arm"); else say "$arm: a seed has no checkpoint; not evaluated"; fi
done
if [ ${#evaluated[@]} = 0 ]; then
  say "ERROR: no arm has checkpoints to evaluate (logs/train_*.log)"
  exit 1
fi
workdirs=$(IFS=,; echo "${evaluated[*]}")

# Validation loss at equal tokens from the training logs (CPU), beside the curves.
JAX_PLATFORMS=cpu timeout -s TERM 60 "$PY" -m castle_jax.eval.compare "${evaluated[@]}" --output="$OUT/compare" \
  > "$LOGS/compare.log" 2>&1 &
compare_pid=$!

budget=$(left 10)
say "evaluating ${evaluated[*]} at the common checkpoint step, at most ${budget}s"
timeout -s TERM -k 10 "$budget" "$PY" -m benchmarks.icl_curve --workdirs="$workdirs" --step=common \
  --max_docs="$MAX_DOCS" --output="$OUT/icl_curve" > "$LOGS/icl_curve.log" 2>&1
status=$?
wait "$compare_pid"
say "compare: exit status $? (logs/compare.log)"
case $status in
  0) say "icl_curve: finished" ;;
  124 | 137) say "icl_curve: stopped at the time limit; icl_curve.json holds the seeds evaluated by then" ;;
  *) say "icl_curve: FAILED (exit status $status)" ;;
esac
cat "$LOGS/icl_curve.log" | tee -a "$OUT/summary.txt"
say "done; results in $OUT"
[ -f "$OUT/icl_curve.json" ]
