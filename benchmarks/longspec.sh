#!/usr/bin/env bash
# LongSpec end to end: train a target, its draft in two stages (short samples with
# anchor-offset indices, then long samples with plain positions) and two ablation drafts
# (no anchor-offset; no noisy training), then benchmark speculative decoding against the
# target's own autoregressive decoding (benchmarks/longspec.py) on held-out files.
# Each training run is bounded by a time budget (SIGTERM saves a checkpoint).
#
#   PYTHON=python3 OUT=results RUNS=/tmp/longspec TARGET_SECONDS=240 DRAFT_SECONDS=60 LONG_SECONDS=60 \
#   TARGET_CONFIG=configs/longspec_target_tiny.py DRAFT_CONFIG=configs/longspec_draft_tiny.py \
#   LONG_CONFIG=configs/longspec_draft_tiny_long.py LENGTHS=256,448 NEW_TOKENS=64 PROMPTS=2 ABLATIONS=1 \
#       bash benchmarks/longspec.sh [--config.key=value ...   (passed to every training run)]
#
# STAGE=train trains only (target, draft and, with ABLATIONS=1, the ablation drafts);
# STAGE=bench benchmarks the runs already in $RUNS; the default does both.
set -u
STAGE=${STAGE:-all}
PY=${PYTHON:-python3}
OUT=${OUT:-runs/longspec_results}
RUNS=${RUNS:-runs/longspec}
mkdir -p "$OUT" "$RUNS"
train() {  # seconds workdir config [flags...]
  local seconds=$1 workdir=$2 config=$3; shift 3
  timeout -s TERM "$seconds" "$PY" -m train --config="$config" --workdir="$workdir" \
      --config.train.progress_bar=False "$@" 2>&1 | grep -v "^WARNING\|warn" | tail -n 4
  mkdir -p "$OUT/$(basename "$workdir")" && cp "$workdir/metrics.jsonl" "$OUT/$(basename "$workdir")/" 2>/dev/null
}
draft_pair() {  # name [flags for both stages...]
  local name=$1; shift
  train "${DRAFT_SECONDS:-60}" "$RUNS/${name}_short" "${DRAFT_CONFIG:-configs/longspec_draft_tiny.py}" \
      --config.model.family_kwargs.target_workdir="$RUNS/target" "$@" "${EXTRA[@]}"
  train "${LONG_SECONDS:-60}" "$RUNS/${name}" "${LONG_CONFIG:-configs/longspec_draft_tiny_long.py}" \
      --config.model.family_kwargs.target_workdir="$RUNS/target" --config.train.init_from="$RUNS/${name}_short" \
      "$@" "${EXTRA[@]}"
}
EXTRA=("$@")
if [ "$STAGE" != bench ]; then
  train "${TARGET_SECONDS:-240}" "$RUNS/target" "${TARGET_CONFIG:-configs/longspec_target_tiny.py}" "${EXTRA[@]}"
  draft_pair draft
  if [ "${ABLATIONS:-1}" = 1 ]; then
    draft_pair no_anchor --config.model.family_kwargs.max_offset=0
    draft_pair no_noise --config.model.family_kwargs.max_shift=1
  fi
fi
[ "$STAGE" = train ] && exit 0
BENCH=("$PY" -m benchmarks.longspec --target_workdir="$RUNS/target" --prompt_lengths="${LENGTHS:-256,448}"
       --new_tokens="${NEW_TOKENS:-64}" --prompts="${PROMPTS:-2}")
# BENCH_FLAGS: the main comparison's rows (default: temperatures 0 and 1, tree and chain).
"${BENCH[@]}" --draft=longspec="$RUNS/draft" ${BENCH_FLAGS:---temperatures=0,1 --tree=4,16,16,16,16 --tree=1,1,1,1,1} \
    --tree_attention=xla --out="$OUT/longspec.json"
if [ "${ABLATIONS:-1}" = 1 ]; then
  "${BENCH[@]}" --draft=longspec="$RUNS/draft" --draft=no_anchor="$RUNS/no_anchor" --draft=no_noise="$RUNS/no_noise" \
      --temperatures=0 --tree=4,16,16,16,16 --tree_attention=xla --tree_attention=reference --out="$OUT/ablations.json"
fi
