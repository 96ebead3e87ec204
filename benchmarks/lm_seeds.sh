#!/usr/bin/env bash
# The CASTLE paper's language-modelling claim (Table 1) at S scale, in minutes: at equal parameters
# and tokens, does CASTLE-SWL-S reach a lower validation loss than Baseline-S? Each arm trains SEEDS
# seeds, seed k of both arms reading the same batches in the same order (train.seeds' pairing), one
# training process per GPU at a time: a process trains one (arm, seed) with
# `--config.train.seeds=SEEDS --config.train.seed_indices=k`, so the processes together fill each
# arm's workdir as one `train.seeds` run (<arm>/seeds.json, <arm>/seed_<k>/). Then
# `castle_jax.eval.compare` gives the paired difference at the largest common token count, and at
# equal training time where the seeds' times overlap.
#
#   OUT=results bash benchmarks/lm_seeds.sh                     # 4 GPUs: seeds 0-3, one per GPU
#   SEEDS=5 SEED_LIST="3 4" OUT=r34 bash benchmarks/lm_seeds.sh # 4 GPUs: 2 seeds x 2 arms, a run per GPU
#   GPUS=2 SEED_LIST="0 1" OUT=r01 bash benchmarks/lm_seeds.sh  # 2 GPUs: half the seeds per call
#   GPUS=1 SEED_LIST="2" OUT=r2 bash benchmarks/lm_seeds.sh     # 1 GPU: one seed per call
#   SMOKE=1 OUT=/tmp/smoke bash benchmarks/lm_seeds.sh          # tiny shapes, XLA attention, on a CPU
#
# Each GPU trains its seeds one after another, both arms of a seed in turn (the arm that goes first
# alternates between GPUs, so that each arm's program is compiled once while the other GPUs train
# and then read from the shared compilation cache). The per-seed recipe does not depend on GPUS or
# SEED_LIST: calls that trained other seeds of the same settings combine by extracting their
# archives into one folder and running `python -m castle_jax.eval.compare <folder>/baseline_s
# <folder>/castle_swl_s` on it.
#
# Settings (environment): PYTHON (python3), OUT (runs/lm_seeds; must not hold results yet; receives
# lm_seeds.tar.gz and a copy of summary.txt), RUNS (checkpoints and the corpus; default a new folder
# under /tmp, not archived), GPUS (those of CUDA_VISIBLE_DEVICES, else those nvidia-smi lists; 1 without one; benchmarks/gpus.sh), SEEDS (the seeds per
# arm: 4), SEED_LIST (the seed indices this call trains: all), ARMS ("baseline_s castle_swl_s"; the
# first is the base of the differences), STEPS (320 steps of 32 x 2048 tokens: 21.0M tokens per
# seed), WARMUP (STEPS / 10), EVAL_EVERY (STEPS / 8), EVAL_BATCHES (32 batches: 2.1M held-out
# tokens), SOURCE_DIR (the corpus: the Python sources of PYTHON's site-packages; "stdlib" for the
# standard library), DEADLINE (seconds after the start by which everything has ended: 570),
# LATER_RESERVE (seconds a GPU keeps for each of its runs still to start: 190), END_RESERVE (seconds
# kept for the comparison and the archive: 50), CASTLE_IMPL (the CASTLE arms' kernels: mosaic; triton
# or xla to compare).
# A run still going when its time is up gets SIGTERM, saves the step in flight and stops; the
# comparison then takes the largest token count that every seed has evaluated.
set -u
start=$SECONDS
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # kept valid after the cd below
SMOKE=${SMOKE:-0}
OUT=$(realpath -m "${OUT:-runs/lm_seeds}")
cd "$(dirname "$0")/.." || exit 1  # the repository root: python -m train, configs/
RUNS=${RUNS:-}
SEEDS=${SEEDS:-4}
SEED_LIST=${SEED_LIST:-$(seq -s ' ' 0 $((SEEDS - 1)))}
ARMS=${ARMS:-baseline_s castle_swl_s}
source benchmarks/gpus.sh  # GPU_IDS, GPUS, gpu_of
if [ "$SMOKE" = 1 ]; then
  # Tiny shapes on a CPU: float32 (the CPU's fast type), the XLA attention, a small directory of
  # Python sources as the corpus (the same code path as site-packages), the same layout of runs.
  STEPS=${STEPS:-6}
  EVAL_EVERY=${EVAL_EVERY:-3}
  EVAL_BATCHES=${EVAL_BATCHES:-1}
  DEADLINE=${DEADLINE:-900}
  LATER_RESERVE=${LATER_RESERVE:-90}
  SOURCE_DIR=${SOURCE_DIR:-$("$PY" -c 'import json, os; print(os.path.dirname(json.__file__))')}
  shape=(--config.model.d_model=64 --config.model.n_layers=1 --config.model.head_dim=32 --config.model.vocab_size=512
         --config.model.dtype=float32 --config.data.seq_len=256 --config.data.batch_size=4
         --config.train.grad_accum_steps=2 --config.train.log_every=2)
  declare -A impl=([baseline_s]=xla [castle_s]=xla [castle_swl_s]=xla)
else
  # 32 sequences of 2048 tokens per step in 2 micro-batches of the configs' 16: a 0.5M-token batch
  # (the paper's) would leave only tens of optimizer steps in a run of minutes.
  STEPS=${STEPS:-320}
  EVAL_EVERY=${EVAL_EVERY:-$((STEPS / 8 > 0 ? STEPS / 8 : 1))}
  EVAL_BATCHES=${EVAL_BATCHES:-32}
  DEADLINE=${DEADLINE:-570}
  LATER_RESERVE=${LATER_RESERVE:-190}
  SOURCE_DIR=${SOURCE_DIR:-$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')}
  shape=(--config.data.batch_size=32 --config.train.grad_accum_steps=2 --config.train.log_every=10)
  # The fastest kernels measured for each arm on an H100, named so that an arm that cannot run
  # its kernel fails instead of training on a slower path.
  declare -A impl=([baseline_s]=cudnn [castle_s]=${CASTLE_IMPL:-mosaic} [castle_swl_s]=${CASTLE_IMPL:-mosaic})
fi
WARMUP=${WARMUP:-$((STEPS / 10 > 0 ? STEPS / 10 : 1))}
END_RESERVE=${END_RESERVE:-50}
heads=(--config.model.n_heads=2)  # SMOKE only: both arms at 2 heads of 32

for arm in $ARMS; do
  [ -f "configs/$arm.py" ] && [ -n "${impl[$arm]:-}" ] || {
    echo "ERROR: ARMS: unknown arm '$arm'; choose from ${!impl[*]}" >&2
    exit 2
  }
done
for k in $SEED_LIST; do
  [[ $k =~ ^[0-9]+$ ]] && [ "$k" -lt "$SEEDS" ] || {
    echo "ERROR: SEED_LIST: '$k' is not a seed index in 0..$((SEEDS - 1)) (SEEDS=$SEEDS)" >&2
    exit 2
  }
done
if [ -e "$OUT/lm_seeds.tar.gz" ] || [ -e "$OUT/summary.txt" ]; then
  echo "ERROR: OUT=$OUT holds the results of an earlier run (never replaced); pass a new OUT" >&2
  exit 2
fi
[ -n "$RUNS" ] || RUNS=$(mktemp -d /tmp/lm_seeds_runs.XXXXXX)
STAGE=$(mktemp -d /tmp/lm_seeds_out.XXXXXX)  # what the archive holds, as lm_seeds/
RESULTS=$STAGE/lm_seeds
LOGS=$RESULTS/logs
mkdir -p "$OUT" "$LOGS" "$RUNS"
say() { echo "[$((SECONDS - start))s] $*" | tee -a "$RESULTS/summary.txt"; }

if [ "$SOURCE_DIR" = stdlib ]; then corpus=(); else corpus=(--config.data.source_dir="$SOURCE_DIR"); fi
data=(--config.data.data_dir="$RUNS/tensorflow_datasets" "${corpus[@]}")
{
  echo "start: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "commit: $(git rev-parse HEAD 2> /dev/null || echo unknown)"
  echo "python: $("$PY" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__)' 2>&1)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2> /dev/null || echo "no nvidia-smi"
  echo "SMOKE=$SMOKE GPUS=$GPUS SEEDS=$SEEDS SEED_LIST=$SEED_LIST ARMS=$ARMS STEPS=$STEPS WARMUP=$WARMUP"
  echo "EVAL_EVERY=$EVAL_EVERY EVAL_BATCHES=$EVAL_BATCHES DEADLINE=$DEADLINE LATER_RESERVE=$LATER_RESERVE"
  echo "END_RESERVE=$END_RESERVE SOURCE_DIR=$SOURCE_DIR RUNS=$RUNS"
} > "$LOGS/environment.txt"
say "environment: $(tr '\n' ' ' < "$LOGS/environment.txt")"

# The corpus, built once before the runs start (each would otherwise wait for the first's build).
timeout -s TERM 150 "$PY" - "${SOURCE_DIR}" "$RUNS/tensorflow_datasets" > "$LOGS/data.log" 2>&1 << 'EOF'
import sys
from castle_jax.data.pipeline import get_builder
source, data_dir = sys.argv[1], sys.argv[2]
builder = get_builder("python_stdlib", data_dir, None if source == "stdlib" else source)
for split, info in builder.info.splits.items():
  print(f"corpus {split}: {info.num_examples} files, {info.num_bytes / 1e6:.1f} MB")
EOF
status=$?
[ $status = 0 ] || { say "ERROR: building the corpus failed (exit status $status; logs/data.log)"; tail -5 "$LOGS/data.log"; exit 1; }
say "corpus ready: $(grep '^corpus' "$LOGS/data.log" | tr '\n' ' ')"

# One compilation cache for every process: a GPU's second arm reads the program the other GPUs compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$RUNS/jax_cache}
monitor=
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 10 > "$LOGS/gpu.csv" 2>&1 &
  monitor=$!
fi

end_at=$((start + DEADLINE - END_RESERVE))
# The jobs of GPU g, "arm:seed" in order: one run per GPU when there are GPUs enough for all of them;
# otherwise the seeds at positions g, g + GPUS, ... of SEED_LIST, both arms of each, the first arm
# alternating with the GPU and the seed.
jobs_of() {
  local g=$1 position=0 k first second
  read -r -a arms <<< "$ARMS"
  read -r -a seeds <<< "$SEED_LIST"
  if [ $((${#arms[@]} * ${#seeds[@]})) -le "$GPUS" ]; then
    # GPUs enough for every run at once: run j (seed-major) on GPU j.
    [ "$g" -lt $((${#arms[@]} * ${#seeds[@]})) ] && echo "${arms[$((g % ${#arms[@]}))]}:${seeds[$((g / ${#arms[@]}))]}"
    return 0
  fi
  for k in $SEED_LIST; do
    if [ $((position % GPUS)) = "$g" ]; then
      for a in $(seq 0 $((${#arms[@]} - 1))); do
        echo "${arms[$(((a + g + position / GPUS) % ${#arms[@]}))]}:$k"
      done
    fi
    position=$((position + 1))
  done
}
run_gpu() {
  local g=$1 jobs job arm k left limit status what
  mapfile -t jobs < <(jobs_of "$g")
  for index in "${!jobs[@]}"; do
    job=${jobs[$index]}
    arm=${job%%:*}
    k=${job##*:}
    left=$((end_at - SECONDS - LATER_RESERVE * (${#jobs[@]} - index - 1)))
    if [ "$left" -lt 30 ]; then
      say "gpu $g: $arm seed $k not started: ${left}s left for it"
      continue
    fi
    command=("$PY" -m train --config="configs/$arm.py" --workdir="$RUNS/$arm" --config.train.seeds="$SEEDS"
             --config.train.seed_indices="$k" --config.train.seeds_mode=sequential
             --config.model.attention_impl="${impl[$arm]}" "${data[@]}" "${shape[@]}"
             --config.train.steps="$STEPS" --config.train.warmup_steps="$WARMUP"
             --config.train.eval_every="$EVAL_EVERY" --config.train.eval_batches="$EVAL_BATCHES"
             --config.train.checkpoint_every=0 --config.train.progress_bar=False)
    [ "$SMOKE" = 1 ] && command+=("${heads[@]}")
    echo "gpu $g, at most ${left}s: CUDA_VISIBLE_DEVICES=$(gpu_of "$g") ${command[*]}" >> "$LOGS/commands.txt"
    say "gpu $g: $arm seed $k, at most ${left}s"
    CUDA_VISIBLE_DEVICES=$(gpu_of "$g") timeout -s TERM -k 20 "$left" "${command[@]}" > "$LOGS/train_${arm}_seed_$k.log" 2>&1
    status=$?
    case $status in 0) what="finished" ;; 124 | 143) what="stopped at its time limit" ;; 137) what="killed after its time limit" ;; *) what="FAILED" ;; esac
    say "gpu $g: $arm seed $k: exit status $status ($what); last line: $(grep -v '^\s*$' "$LOGS/train_${arm}_seed_$k.log" | tail -1)"
  done
}
say "training arms '$ARMS', seeds '$SEED_LIST' of $SEEDS, on $GPUS GPU(s), until $((DEADLINE - END_RESERVE))s after the start"
pids=()
for g in $(seq 0 $((GPUS - 1))); do
  run_gpu "$g" &
  pids+=($!)
done
wait "${pids[@]}"
[ -n "$monitor" ] && kill "$monitor" 2> /dev/null

# What must survive: each arm's seeds.json and each seed's config and metrics (checkpoints stay in RUNS).
arms_done=()
for arm in $ARMS; do
  [ -f "$RUNS/$arm/seeds.json" ] || { say "$arm: no seed started"; continue; }
  mkdir -p "$RESULTS/$arm"
  cp "$RUNS/$arm/seeds.json" "$RESULTS/$arm/"
  for seed_dir in "$RUNS/$arm"/seed_*; do
    mkdir -p "$RESULTS/$arm/$(basename "$seed_dir")"
    cp "$seed_dir/config.json" "$seed_dir/metrics.jsonl" "$RESULTS/$arm/$(basename "$seed_dir")/" 2> /dev/null
  done
  arms_done+=("$RESULTS/$arm")
done

# Per run: how far it got, its last validation loss and its training speed after the first log
# window (which holds the compilation).
"$PY" - "$RESULTS" $ARMS << 'EOF' 2>&1 | tee -a "$RESULTS/summary.txt"
import glob, json, os, statistics, sys
results, arms = sys.argv[1], sys.argv[2:]
speeds = {}
for arm in arms:
  for seed_dir in sorted(glob.glob(os.path.join(results, arm, "seed_*"))):
    path = os.path.join(seed_dir, "metrics.jsonl")
    records = [json.loads(line) for line in open(path)] if os.path.isfile(path) else []
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    if not train:
      print(f"  {arm} {os.path.basename(seed_dir)}: no training step logged")
      continue
    steady = [r["tokens_per_sec"] for r in train[1:] if "tokens_per_sec" in r]
    speed = statistics.median(steady) if steady else None
    if speed:
      speeds.setdefault(arm, []).append(speed)
    last_eval = f"eval loss {evals[-1]['loss']:.4f} at step {evals[-1]['step']}" if evals else "no evaluation"
    print(f"  {arm} {os.path.basename(seed_dir)}: step {train[-1]['step']}, {last_eval}, "
          f"{train[-1].get('elapsed_s', float('nan')):.0f} s of training (compilation included), "
          + (f"{speed / 1e3:.1f}K tokens/s after the first log window" if speed else "no steady speed"))
for arm, values in speeds.items():
  print(f"  {arm}: median {statistics.median(values) / 1e3:.1f}K tokens/s over {len(values)} seed(s)")
if len(speeds) == len(arms) and len(arms) >= 2:
  base = statistics.median(speeds[arms[0]])
  for arm in arms[1:]:
    print(f"  {arm} / {arms[0]} tokens/s: {statistics.median(speeds[arm]) / base:.3f} (at equal time, {arms[0]} "
          f"trains {base / statistics.median(speeds[arm]):.2f}x the tokens)")
EOF

if [ ${#arms_done[@]} -ge 2 ]; then
  # compare reads metrics only: on the CPU, so that it never waits for a GPU.
  names=("${arms_done[@]##*/}")
  root=$PWD
  (cd "$RESULTS" && PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=cpu timeout -s TERM 30 "$PY" -m castle_jax.eval.compare "${names[@]}" --output=compare) \
    > "$LOGS/compare.log" 2>&1
  say "compare: exit status $? (logs/compare.log)"
  tee -a "$RESULTS/summary.txt" < "$LOGS/compare.log"
else
  say "ERROR: fewer than two arms have runs to compare"
fi
say "done"
tar -czf "$OUT/lm_seeds.tar.gz" -C "$STAGE" lm_seeds && cp "$RESULTS/summary.txt" "$OUT/summary.txt"
echo "wrote $OUT/lm_seeds.tar.gz ($(du -h "$OUT/lm_seeds.tar.gz" | cut -f1)); checkpoints in $RUNS"
grep -q "training tokens" "$LOGS/compare.log" 2> /dev/null
