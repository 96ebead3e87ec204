#!/usr/bin/env bash
# Passkey retrieval far past the training length on one GPU, the paper's recipe:
#   1. language-model pre-training of configs/drt_small.py (16K-token windows),
#   2. a passkey fine-tune from it (configs/drt_small_passkey.py, train.init_from),
#   3. passkey accuracy at each length of EVALS (python -m castle_jax.eval.passkey),
#      with the chunk memory in host RAM; device memory per length in the JSON.
# Each training run is bounded by a time budget (SIGTERM saves a checkpoint).
#
#   PYTHON=python3 OUT=results RUNS=runs/drt_passkey PRETRAIN_SECONDS=300 FINETUNE_SECONDS=170 \
#   EVALS=4096:20,65536:20,1048576:10 bash benchmarks/drt_passkey.sh [--config.key=value ...]
#
# EVALS: length:examples pairs, one evaluation process each. STAGE=train trains only,
# STAGE=eval evaluates the runs already in $RUNS, the default does both. Extra flags go
# to both training runs (e.g. smaller shapes for a dry run on CPU).
set -u
STAGE=${STAGE:-all}
PY=${PYTHON:-python3}
OUT=${OUT:-runs/drt_passkey_results}
RUNS=${RUNS:-runs/drt_passkey}
mkdir -p "$OUT" "$RUNS"
train() {  # seconds workdir config [flags...]
  local seconds=$1 workdir=$2 config=$3; shift 3
  timeout -s TERM "$seconds" "$PY" -m train --config="$config" --workdir="$workdir" \
      --config.train.progress_bar=False "$@" 2>&1 | grep -v "^WARNING\|warn" | tail -n 6
  local status=${PIPESTATUS[0]}
  echo "$(basename "$workdir"): exit status $status (124: stopped by the time budget after saving)"
  mkdir -p "$OUT/$(basename "$workdir")" && cp "$workdir/metrics.jsonl" "$OUT/$(basename "$workdir")/" 2>/dev/null
  # A run that failed (rather than ran out of time) leaves nothing for the next stage.
  if [ "$status" != 0 ] && [ "$status" != 124 ]; then exit "$status"; fi
}
if [ "$STAGE" != eval ]; then
  train "${PRETRAIN_SECONDS:-300}" "$RUNS/pretrain" configs/drt_small.py "$@"
  train "${FINETUNE_SECONDS:-170}" "$RUNS/passkey" configs/drt_small_passkey.py \
      --config.train.init_from="$RUNS/pretrain" "$@"
fi
[ "$STAGE" = train ] && exit 0
for pair in $(echo "${EVALS:-4096:20,65536:20}" | tr , ' '); do
  length=${pair%%:*} examples=${pair##*:}
  "$PY" -m castle_jax.eval.passkey --workdir="$RUNS/passkey" --lengths="$length" --examples="$examples" \
      --output="$OUT/passkey_$length.json" 2>&1 | grep -v "^WARNING\|warn" | tail -n 4
done
