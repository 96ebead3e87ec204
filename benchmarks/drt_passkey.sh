#!/usr/bin/env bash
# Passkey retrieval far past the training length on one GPU:
#   trains configs/drt_small_passkey.py from scratch for TRAIN_SECONDS (SIGTERM then saves
#   a checkpoint), then scores passkey prompts of LENGTHS tokens with the chunk memory in
#   host RAM (python -m castle_jax.eval.passkey; device memory per length in the JSON).
#
#   PYTHON=python3 OUT=results TRAIN_SECONDS=270 LENGTHS=2048,16384,131072,1048576 EXAMPLES=10 \
#       bash benchmarks/drt_passkey.sh [--config.key=value ...]
set -u
OUT=${OUT:-runs/drt_passkey}
WORKDIR=${WORKDIR:-/tmp/drt_small_passkey}
mkdir -p "$OUT"
timeout -s TERM "${TRAIN_SECONDS:-270}" "${PYTHON:-python3}" -m train --config=configs/drt_small_passkey.py --workdir="$WORKDIR" \
    --config.train.progress_bar=False "$@"
echo "train exit status $? (124/143: stopped by the time budget after saving)"
cp "$WORKDIR/metrics.jsonl" "$OUT/" 2>/dev/null
"${PYTHON:-python3}" -m castle_jax.eval.passkey --workdir="$WORKDIR" --lengths="${LENGTHS:-2048,16384,131072,1048576}" \
    --examples="${EXAMPLES:-10}" --output="$OUT/passkey.json"
