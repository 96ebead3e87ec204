#!/usr/bin/env bash
# The GCA/DRT paper's decisive ablation (Table 1, "random retriever") in miniature: does a
# learned causal retriever lower perplexity where chunks picked at random do not? Three arms of
# configs/drt_small.py's shapes, trained on the same batches in the same order (seed k of every
# arm reads the same data), SEEDS vmapped seeds per arm, the arms at once, one per GPU:
#   learned  DRT as configured: the top-8 earlier chunks by learned relevance (Gumbel noise in
#            training), read by GCA;
#   random   the same DRT, its 8 chunks drawn uniformly among the earlier ones, GCA still
#            learned (family_kwargs retriever="random");
#   swa      the decoder without retrieval: the same 8 layers of ALiBi sliding-window attention
#            (window 64), no chunk encoder, no GCA.
# Each arm stops at ARM_SECONDS (a stopped run saves its step) and keeps a checkpoint every
# STEPS / 8 steps. The arms do not train equally fast (the window baseline has no retrieval), so
# every seed is evaluated at the largest checkpoint step that every seed of every arm reached
# (equal tokens): perplexity at LENGTHS on the validation split (castle_jax.eval.perplexity, the
# same WINDOWS windows for every seed and arm); then castle_jax.eval.compare puts the arms side
# by side at each length, paired by seed, the learned arm first.
#
#   OUT=results bash benchmarks/drt_perplexity_seeds.sh              # 3 GPUs, about 9.5 minutes
#   SMOKE=1 OUT=/tmp/drt_ppl bash benchmarks/drt_perplexity_seeds.sh   # tiny shapes on a CPU
#
# Settings (environment): PYTHON (python3), OUT (must not hold results), RUNS (checkpoints and
# the corpus; default a new folder under /tmp), ARMS ("learned random swa"), SEEDS (3), STEPS
# (1200 steps of 4 x 16,380 tokens: 78.6M tokens per seed; the cosine schedule's length),
# ARM_SECONDS (450), LENGTHS (16384,65536: the training length and 4 times it), WINDOWS (32
# windows per length), GPUS (those of CUDA_VISIBLE_DEVICES, else those nvidia-smi lists; benchmarks/gpus.sh; arms beyond it share GPUs), SOURCE_DIR
# (the corpus: the Python sources of PYTHON's site-packages). Extra arguments go to every
# training run.
set -u
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # kept valid after the cd below
OUT=$(realpath -m "${OUT:-runs/drt_perplexity_seeds}")
cd "$(dirname "$0")/.." || exit 1  # the repository root: python -m train, configs/
ARMS=${ARMS:-learned random swa}
source benchmarks/gpus.sh  # GPU_IDS, GPUS, gpu_of
if [ "${SMOKE:-0}" = 1 ]; then
  SEEDS=${SEEDS:-2} STEPS=${STEPS:-8} ARM_SECONDS=${ARM_SECONDS:-400} LENGTHS=${LENGTHS:-512,1024} WINDOWS=${WINDOWS:-2}
  SOURCE_DIR=${SOURCE_DIR:-$("$PY" -c 'import json, os; print(os.path.dirname(json.__file__))')}
  shape=(--config.model.d_model=64 --config.model.n_heads=2 --config.model.n_layers=2 --config.model.dtype=float32
         --config.model.sliding_window=16 --config.data.seq_len=512 --config.data.batch_size=2
         --config.train.eval_every=2 --config.train.eval_batches=1 --config.train.log_every=2)
  chunk=15 encoder_layers=1 top_k=2
else
  SEEDS=${SEEDS:-3} STEPS=${STEPS:-1200} ARM_SECONDS=${ARM_SECONDS:-450} LENGTHS=${LENGTHS:-16384,65536} WINDOWS=${WINDOWS:-32}
  SOURCE_DIR=${SOURCE_DIR:-$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')}
  shape=(--config.train.eval_every=250 --config.train.log_every=50)
  chunk=63 encoder_layers=2 top_k=8
fi
if [ -e "$OUT/summary.txt" ]; then
  echo "ERROR: OUT=$OUT holds the results of an earlier run (never replaced); pass a new OUT" >&2
  exit 2
fi
RUNS=${RUNS:-$(mktemp -d /tmp/drt_perplexity_runs.XXXXXX)}
mkdir -p "$OUT/logs" "$RUNS"
say() { echo "[${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
drt_kwargs() {  # retriever
  echo "--config.model.family_kwargs={'chunk_size': $chunk, 'top_k': $top_k, 'retrieval_groups': 1, 'encoder_layers': $encoder_layers, 'retriever': '$1'}"
}
every=$((STEPS / 8 > 0 ? STEPS / 8 : 1))
common=(--config=configs/drt_small.py --config.train.seeds="$SEEDS" --config.train.steps="$STEPS"
        --config.train.checkpoint_every="$every" --config.train.keep_checkpoints=9 --config.train.progress_bar=False
        --config.data.source_dir="$SOURCE_DIR" --config.data.data_dir="$RUNS/tensorflow_datasets" "${shape[@]}")
for arm in $ARMS; do
  case $arm in learned | random | swa) ;; *) say "ERROR: unknown arm '$arm' (learned, random, swa)"; exit 2 ;; esac
done
{
  echo "start: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse HEAD 2> /dev/null || echo unknown)"
  "$PY" -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())' 2>&1 | tail -n 1
  echo "ARMS=$ARMS SEEDS=$SEEDS STEPS=$STEPS ARM_SECONDS=$ARM_SECONDS LENGTHS=$LENGTHS WINDOWS=$WINDOWS GPUS=$GPUS"
} > "$OUT/logs/environment.txt"
say "$(tr '\n' ' ' < "$OUT/logs/environment.txt")"

# The corpus, built once before the arms start (each would otherwise wait for the first's build).
timeout -s TERM 300 "$PY" - "$SOURCE_DIR" "$RUNS/tensorflow_datasets" > "$OUT/logs/corpus.log" 2>&1 << 'PYTHON'
import sys
from castle_jax.data.pipeline import get_builder
builder = get_builder("python_stdlib", sys.argv[2], sys.argv[1])
for split, info in builder.info.splits.items():
  print(f"corpus {split}: {info.num_examples} files, {info.num_bytes / 1e6:.1f} MB")
PYTHON
say "corpus: exit status $?; $(grep '^corpus' "$OUT/logs/corpus.log" | tr '\n' ' ')"

train_arm() {  # arm gpu
  local arm=$1 gpu=$2 model
  case $arm in
    learned | random) model=("$(drt_kwargs "$arm")") ;;
    swa) model=(--config.model.family=transformer "--config.model.family_kwargs={}") ;;
  esac
  local command=("$PY" -m train "${common[@]}" "${model[@]}" "${extra[@]}" --workdir="$RUNS/$arm")
  echo "CUDA_VISIBLE_DEVICES=$gpu ${command[*]}" >> "$OUT/logs/commands.txt"
  CUDA_VISIBLE_DEVICES=$gpu timeout -s TERM -k 30 "$ARM_SECONDS" "${command[@]}" > "$OUT/logs/train_$arm.log" 2>&1
  say "train $arm: exit status $? (124: stopped at its time limit); $(grep -v '^\s*$' "$OUT/logs/train_$arm.log" | grep '^step' | tail -n 1)"
}
evaluate_arm() {  # arm gpu step: every seed, one after another
  local arm=$1 gpu=$2 step=$3 seed
  for seed in $(seq 0 $((SEEDS - 1))); do
    CUDA_VISIBLE_DEVICES=$gpu "$PY" -m castle_jax.eval.perplexity --workdir="$RUNS/$arm/seed_$seed" --step="$step" \
      --lengths="$LENGTHS" --windows="$WINDOWS" > "$OUT/logs/perplexity_${arm}_seed$seed.log" 2>&1
    say "perplexity $arm seed $seed at step $step: exit status $?"
  done
}
extra=("$@")
read -r -a arm_list <<< "$ARMS"
# Arms that share a GPU split its memory.
(( ${#arm_list[@]} > GPUS )) && export XLA_PYTHON_CLIENT_MEM_FRACTION=$(awk -v n="$(( (${#arm_list[@]} + GPUS - 1) / GPUS ))" 'BEGIN { printf "%.2f", 0.9 / n }')
for i in "${!arm_list[@]}"; do
  train_arm "${arm_list[$i]}" "$(gpu_of "$i")" &
done
wait

# The largest checkpoint step that every seed of every arm holds.
seed_dirs=()
for arm in "${arm_list[@]}"; do
  for seed in $(seq 0 $((SEEDS - 1))); do seed_dirs+=("$RUNS/$arm/seed_$seed"); done
done
common_step=$(JAX_PLATFORMS=cpu "$PY" -m castle_jax.eval.common_step "${seed_dirs[@]}" 2> "$OUT/logs/common_step.log")
if [ "$common_step" -gt 0 ] 2> /dev/null; then
  say "evaluating every seed at step $common_step, the largest that every seed of every arm reached"
  for i in "${!arm_list[@]}"; do
    evaluate_arm "${arm_list[$i]}" "$(gpu_of "$i")" "$common_step" &
  done
  wait
else
  say "ERROR: no checkpoint step that every seed of every arm holds; nothing evaluated: $(tail -1 "$OUT/logs/common_step.log")"
fi

# What must survive: each arm's seeds.json, each seed's config, metrics and perplexity results.
for arm in "${arm_list[@]}"; do
  for seed_dir in "$RUNS/$arm"/seed_*; do
    [ -d "$seed_dir" ] || continue
    mkdir -p "$OUT/$arm/$(basename "$seed_dir")/eval"
    cp "$seed_dir/config.json" "$seed_dir/metrics.jsonl" "$OUT/$arm/$(basename "$seed_dir")/" 2> /dev/null
    cp "$seed_dir"/eval/perplexity_* "$OUT/$arm/$(basename "$seed_dir")/eval/" 2> /dev/null
  done
  cp "$RUNS/$arm/seeds.json" "$OUT/$arm/" 2> /dev/null
done
root=$PWD
for length in ${LENGTHS//,/ }; do
  # compare reads results only: on the CPU, from OUT (the arms' folders), this repository importable.
  (cd "$OUT" && PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} JAX_PLATFORMS=cpu "$PY" -m castle_jax.eval.compare "${arm_list[@]}" --results=perplexity \
    --length="$length" --output="compare_$length") > "$OUT/logs/compare_$length.log" 2>&1
  say "compare at $length tokens: exit status $?"
  tee -a "$OUT/summary.txt" < "$OUT/logs/compare_$length.log"
done
say "done"
