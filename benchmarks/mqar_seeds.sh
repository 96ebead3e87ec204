#!/usr/bin/env bash
# Multi-query associative recall (docs/tasks.md) over seeds, by stages of more pairs, for several
# attentions at once. Two questions, by the arms chosen:
# - Does a larger power-attention state recall more? Gated power attention at p = 2 and p = 4 (this
#   library takes even powers only: the weights must be positive to be normalized, so p = 1 does not
#   exist here). With heads of 8, a p = 2 head keeps D = C(9, 2) = 36 expanded keys (324 numbers with
#   the normalizer), about as many as the 32 pairs of the last stage; p = 4 keeps D = C(11, 4) = 330
#   (2,970 numbers), near full attention's KV cache at the end of a 32-pair prompt (192 tokens).
# - Do CASTLE's lookahead keys change recall? CASTLE and CASTLE-SWL (lookahead keys over the last 16
#   tokens) with half of N_HEADS heads, at parameter parity with full attention's N_HEADS (each CASTLE
#   head has a second set of key and value projections).
# Full softmax attention (`mha`) runs beside them as the baseline and the check that the task is
# learned at this budget.
#
# The pairs are reached by stages: in CPU probes full attention did not learn 8 pairs from scratch in
# 1,500 steps, but learned them in 250 steps starting from a model that had learned 4, and 16 from that
# one in 500 (docs/reproduction.md). So each arm trains STAGES in order, stage 1 from random parameters
# and every later stage from the previous stage's final parameters (train.init_from: seed k from seed k
# of the same arm), every key queried (queries = pairs: the most answers per prompt; recall is read from
# the first query, which elimination cannot answer), each stage with its own step count and the shortest
# seq_len its pairs allow. The model is the same at every stage (init_from needs equal shapes), so its
# width is set once, for the last stage's pairs: N_HEADS heads of HEAD_DIM in a stream of D_MODEL. The
# keys are drawn from the same KEY_VOCAB keys at every stage, so the last stage brings more pairs per
# prompt, not keys the model never saw. Each arm: SEEDS vmapped seeds, the arms trained at once as separate processes sharing the
# GPU; then every seed is scored at the last stage's pairs, at the newest checkpoint step of the last
# stage that all seeds hold, on EXAMPLES held-out prompts (castle_jax.eval.tasks), and
# castle_jax.eval.compare puts the arms side by side (query accuracy and answer loss, paired by seed,
# differences to p = 2). Earlier stages are not scored (a scoring process per seed and stage would cost
# the GPU budget); their eval answer loss per seed is in summary.txt and their metrics.jsonl.
#
#   OUT=results bash benchmarks/mqar_seeds.sh                        # p2 p4 mha
#   ARMS="mha castle castle_swl" OUT=results_castle bash benchmarks/mqar_seeds.sh
#   SMOKE=1 OUT=/tmp/mqar_smoke bash benchmarks/mqar_seeds.sh      # tiny shapes on a CPU
#
# Settings (environment): PYTHON (python3), OUT (runs/mqar_seeds; must not hold results yet),
# RUNS (checkpoints; default a new folder under /tmp), SEEDS (3), STAGES (pairs per stage: "4 8 16 32"),
# STAGE_STEPS (steps per stage, one number for every stage or one per stage: "3000 300 500 700"; in the
# CPU probes full attention with 4 heads of 16 learned 4 pairs from scratch by step 500 (eval answer loss
# 0.03), 8 from 4 and 16 from 8 were at 0.01 or below by step 250; with this script's 8 heads of 8 it
# learned 4 pairs between steps 750 and 1,500; on a GPU with a first stage of 1,500 steps 2 of 3 seeds of
# p = 2 and of p = 4 had not learned 4 pairs, while a CPU run of p = 2 with 3,000 steps had every seed
# below 0.01), STAGE_START (30; see Time below), KEY_VOCAB (max(26, the largest stage's pairs)), HEAD_DIM
# (8), N_HEADS (8), D_MODEL (N_HEADS x HEAD_DIM; set wider to size the power state, N_HEADS x
# C(HEAD_DIM + p - 1, p) expanded keys per layer, apart from the model's width), BATCH (128: no run with
# 32 or 64 prompts per step learned the lookup in the probes, 128 did), LAYOUT (data.mqar.layout: compact, "d4", the default, or colon,
# " d:4", which full attention did not learn in the probes: kept to test exactly that), ARMS ("p2 p4
# mha"; any of p2 p4 mha castle castle_swl, and p2_norm p4_norm: power attention with the authors' LayerNorm
# on each head's output; the first is the base of the differences; castle arms need an even N_HEADS), DEADLINE (seconds after the start by which
# everything has ended: 510), EVAL_RESERVE (seconds kept for scoring: 90), EXAMPLES (1000), MEM_FRACTION
# (each training process's share of the GPU memory: 0.2; the scoring processes, one per seed, allocate
# what they use), WORKERS (data.worker_count, grain processes drawing each seed's prompts, so
# ARMS x SEEDS x WORKERS processes in all: 1, SMOKE 0; drawn in the training process, the prompts of 3
# seeds x 128 per step took longer than an H100's step of these models, and with 3 workers per seed
# the later stages' workers of 3 arms x 5 seeds did not start within STAGE_START on a 16-core host), GPUS
# (those of CUDA_VISIBLE_DEVICES, else those nvidia-smi lists, 1 without one; benchmarks/gpus.sh: arm i
# trains on the i-th mod GPUS, and the scoring processes are spread likewise). PAIRS, QUERIES and STEPS of the one-stage version are refused with an error naming
# what replaced them, since a run meant for 32 pairs or 10,000 steps would otherwise run the defaults.
# Time: training has until DEADLINE - EVAL_RESERVE. When a stage starts it gets STAGE_START seconds for
# starting (importing, compiling, the data workers' first batch: 30; paid by every stage, however few its
# steps; a stage waits longer for its first batch the more data workers start at once on the host, so
# raise it when runs share a host) plus its share of the
# time left after the starts of it and the later stages, in proportion to its STAGE_STEPS among theirs.
# So a stage that finishes early leaves its time to the later ones, and one stopped at its limit (it
# saves a checkpoint of the step it stopped at, from which the next stage starts) leaves theirs
# untouched, but for the seconds its checkpoint takes after the stop.
# Power attention runs its attention form (implementation "reference": the same function as the
# recurrent state, exact for any p, and cheap at these lengths); softmax attention runs on XLA; float32.
# Written to OUT: <arm>/seeds.json, <arm>/seed_<k>/{config.json,metrics.jsonl,eval/*.json} (the last
# stage), stages/<arm>/stage<i>_pairs<P>/seed_<k>/{config.json,metrics.jsonl} (every stage; config.json
# names the train.init_from a stage started from), compare_query_accuracy/, compare_answer_loss/ and
# compare_first_query/ (the first query's accuracy, which elimination cannot give;
# castle_jax.eval.compare), logs/ (train_<arm>_stage<i>.log per stage), summary.txt.
# An arm that fails does not sink the others: a stage that fails or leaves a seed without a checkpoint
# ends its arm (the later stages are not run); the arms scored are those whose last stage's seeds all
# hold a checkpoint step that the arms kept before them (in ARMS order) hold too, and those of them
# whose every seed was scored are compared (differences to the first of them). summary.txt ends with a
# line "ARM <arm>: ..." for each arm whose training failed (with its log's last line) or that was left
# out of the scoring or the comparison, and why. Exit status 0 only when every arm trained every stage,
# was scored and was compared (a stage stopped at its time limit counts as trained); 2 for bad settings.
set -u
start=$SECONDS
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # kept valid after the cd below
SMOKE=${SMOKE:-0}
OUT=$(realpath -m "${OUT:-runs/mqar_seeds}")
cd "$(dirname "$0")/.." || exit 1  # the repository root: python -m train, configs/
RUNS=${RUNS:-}
ARMS=${ARMS:-p2 p4 mha}
MEM_FRACTION=${MEM_FRACTION:-0.2}
source benchmarks/gpus.sh  # GPU_IDS, GPUS, gpu_of
for old in PAIRS QUERIES STEPS; do
  if [ -n "${!old:-}" ]; then
    echo "ERROR: $old is no longer read: the pairs come in stages, each querying all its pairs; set STAGES" \
      "(pairs per stage) and STAGE_STEPS (steps per stage)" >&2
    exit 2
  fi
done
if [ "$SMOKE" = 1 ]; then
  SEEDS=${SEEDS:-2}
  STAGES=${STAGES:-2 4}
  STAGE_STEPS=${STAGE_STEPS:-4}
  N_HEADS=${N_HEADS:-2}
  EXAMPLES=${EXAMPLES:-32}
  DEADLINE=${DEADLINE:-900}
  EVAL_RESERVE=${EVAL_RESERVE:-300}
  BATCH=${BATCH:-4}
  STAGE_START=${STAGE_START:-60}
  WORKERS=${WORKERS:-0}
else
  SEEDS=${SEEDS:-3}
  STAGES=${STAGES:-4 8 16 32}
  STAGE_STEPS=${STAGE_STEPS:-3000 300 500 700}
  N_HEADS=${N_HEADS:-8}
  EXAMPLES=${EXAMPLES:-1000}
  DEADLINE=${DEADLINE:-510}
  EVAL_RESERVE=${EVAL_RESERVE:-90}
  BATCH=${BATCH:-128}
  STAGE_START=${STAGE_START:-30}
  WORKERS=${WORKERS:-1}
fi
HEAD_DIM=${HEAD_DIM:-8}
D_MODEL=${D_MODEL:-$((N_HEADS * HEAD_DIM))}
LAYOUT=${LAYOUT:-compact}

case $LAYOUT in colon | compact) ;; *) echo "ERROR: LAYOUT must be colon or compact, got '$LAYOUT'" >&2; exit 2 ;; esac
for arm in $ARMS; do
  case $arm in
    p2 | p4 | p2_norm | p4_norm | mha | castle | castle_swl) ;;
    *) echo "ERROR: ARMS: unknown arm '$arm'; choose from p2 p4 p2_norm p4_norm mha castle castle_swl" >&2; exit 2 ;;
  esac
done
read -r -a pairs_of <<< "$STAGES"
read -r -a steps_of <<< "$STAGE_STEPS"
n=${#pairs_of[@]}
is_count() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }
[ "$n" -gt 0 ] || { echo "ERROR: STAGES is empty; give the pairs of each stage, e.g. '4 8 16 32'" >&2; exit 2; }
largest=0
for p in "${pairs_of[@]}"; do
  is_count "$p" || { echo "ERROR: STAGES='$STAGES': '$p' is not a positive number of pairs" >&2; exit 2; }
  [ "$p" -gt "$largest" ] && largest=$p
done
[ ${#steps_of[@]} = 1 ] && for ((i = 1; i < n; i++)); do steps_of[i]=${steps_of[0]}; done
if [ ${#steps_of[@]} != "$n" ]; then
  echo "ERROR: STAGE_STEPS='$STAGE_STEPS' gives ${#steps_of[@]} step counts for $n stages (STAGES='$STAGES'):" \
    "give one, or one per stage" >&2
  exit 2
fi
if ! is_count "$STAGE_START" && [ "$STAGE_START" != 0 ]; then
  echo "ERROR: STAGE_START='$STAGE_START' is not a number of seconds" >&2
  exit 2
fi
for value in "$N_HEADS" "$HEAD_DIM" "$D_MODEL"; do
  is_count "$value" || { echo "ERROR: N_HEADS, HEAD_DIM and D_MODEL must be positive numbers, got '$N_HEADS', '$HEAD_DIM', '$D_MODEL'" >&2; exit 2; }
done
if [[ " $ARMS " == *" castle"* ]] && ((N_HEADS % 2)); then
  echo "ERROR: N_HEADS=$N_HEADS is odd: the castle arms take half of it (parameter parity with mha); give an even N_HEADS" >&2
  exit 2
fi
for s in "${steps_of[@]}"; do
  is_count "$s" || { echo "ERROR: STAGE_STEPS='$STAGE_STEPS': '$s' is not a positive step count" >&2; exit 2; }
done
KEY_VOCAB=${KEY_VOCAB:-$((largest > 26 ? largest : 26))}
if ! is_count "$KEY_VOCAB" || [ "$KEY_VOCAB" -lt "$largest" ]; then
  echo "ERROR: KEY_VOCAB='$KEY_VOCAB' must be a number of keys at least the largest stage's $largest pairs" >&2
  exit 2
fi
# A key takes 1 byte (a..z), 2 (aa..zz) or 3 (aaa..zzz), its value 1 digit; "colon" adds a space and ":".
item=$((KEY_VOCAB > 702 ? 4 : KEY_VOCAB > 26 ? 3 : 2))
[ "$LAYOUT" = compact ] || item=$((item + 2))
# The longest prompt is BOS and 2 x pairs items; the inputs leave out its last token.
seq_len_of() { echo $((2 * $1 * item)); }
stage_name() { echo "stage$(($1 + 1))_pairs${pairs_of[$1]}"; }
last=$(stage_name $((n - 1)))

if [ -e "$OUT/summary.txt" ] || [ -e "$OUT/logs" ]; then
  echo "ERROR: OUT=$OUT holds the results of an earlier run (never replaced); pass a new OUT" >&2
  exit 2
fi
[ -n "$RUNS" ] || RUNS=$(mktemp -d /tmp/power_mqar_runs.XXXXXX)
mkdir -p "$OUT/logs" "$RUNS"
LOGS=$OUT/logs
left() { echo $((DEADLINE - (SECONDS - start) - $1)); }
say() { echo "[$((SECONDS - start))s] $*" | tee -a "$OUT/summary.txt"; }
say "commit $(git rev-parse HEAD 2>/dev/null || echo unknown); SMOKE=$SMOKE SEEDS=$SEEDS STAGES='$STAGES'" \
  "STAGE_STEPS='${steps_of[*]}' KEY_VOCAB=$KEY_VOCAB HEAD_DIM=$HEAD_DIM N_HEADS=$N_HEADS D_MODEL=$D_MODEL BATCH=$BATCH LAYOUT=$LAYOUT" \
  "WORKERS=$WORKERS" \
  "seq_len $(for ((i = 0; i < n; i++)); do printf '%s ' "$(seq_len_of "${pairs_of[i]}")"; done)EXAMPLES=$EXAMPLES" \
  "RUNS=$RUNS $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"

common=(--config=configs/tasks_mqar_tiny.py --config.train.seeds="$SEEDS" --config.model.n_layers=2
        --config.model.d_model="$D_MODEL" --config.model.n_heads="$N_HEADS" --config.model.head_dim="$HEAD_DIM"
        --config.data.mqar.key_vocab="$KEY_VOCAB" --config.data.mqar.layout="$LAYOUT"
        --config.data.batch_size="$BATCH" --config.train.eval_batches=4 --config.train.keep_checkpoints=10
        --config.data.worker_count="$WORKERS" --config.train.progress_bar=False)
# The newest eval loss of each seed of a stage's workdir: "seed 0 1.234 at step 500; ...".
eval_losses() {
  "$PY" - "$1" "$SEEDS" << 'EOF'
import json, os, sys
top, seeds, parts = sys.argv[1], int(sys.argv[2]), []
for k in range(seeds):
  newest = None
  try:
    with open(os.path.join(top, f"seed_{k}", "metrics.jsonl")) as f:
      for line in f:
        record = json.loads(line)
        if record.get("split") == "eval" and "loss" in record:
          newest = record
  except (OSError, ValueError):
    pass
  parts.append(f"seed {k} " + (f"{newest['loss']:.3f} at step {newest['step']}" if newest else "none"))
print("; ".join(parts))
EOF
}
# Every seed of a stage's workdir holds a checkpoint (what the next stage starts from).
all_seeds_hold_a_checkpoint() {
  local k
  for ((k = 0; k < SEEDS; k++)); do
    compgen -G "$1/seed_$k/checkpoints/[0-9]*" > /dev/null || return 1
  done
}
# One arm's stages in order, in the background; its verdict ("ok" or what went wrong) goes to
# logs/train_<arm>.verdict, since a background job cannot set the caller's variables.
train_arm() {  # arm lane
  local arm=$1 lane=$2 i j steps_left time_left stepping share status what previous="" top name log verdict=ok attention command power kwargs
  case $arm in
    p2 | p4 | p2_norm | p4_norm)
      power=${arm#p}
      kwargs="'p': ${power%_norm}"
      [[ $arm == *_norm ]] && kwargs+=", 'output_norm': 'layernorm'"
      attention=(--config.model.attention=power "--config.model.attention_kwargs={$kwargs}"
                 --config.model.attention_impl=reference) ;;
    mha) attention=(--config.model.attention_impl=xla) ;;
    castle) attention=(--config.model.attention=castle --config.model.n_heads=$((N_HEADS / 2))) ;;
    castle_swl) attention=(--config.model.attention=castle_swl --config.model.n_heads=$((N_HEADS / 2))
                           "--config.model.attention_kwargs={'lookahead_window': 16}") ;;
  esac
  for ((i = 0; i < n; i++)); do
    name=$(stage_name "$i")
    top=$RUNS/$arm/$name
    log=$LOGS/train_${arm}_stage$((i + 1)).log
    steps_left=0
    for ((j = i; j < n; j++)); do steps_left=$((steps_left + steps_of[j])); done
    time_left=$(left "$EVAL_RESERVE")
    stepping=$((time_left - STAGE_START * (n - i)))
    if [ "$stepping" -gt 0 ]; then
      share=$((STAGE_START + stepping * steps_of[i] / steps_left))
    else
      share=$((time_left / (n - i)))
    fi
    if [ "$share" -lt 1 ]; then
      verdict="$name got no time (DEADLINE=$DEADLINE, EVAL_RESERVE=$EVAL_RESERVE): not run, nor the stages after it"
      break
    fi
    local steps=${steps_of[i]} every=$((steps_of[i] / 5 > 0 ? steps_of[i] / 5 : 1)) pairs=${pairs_of[i]}
    command=("$PY" -m train --workdir="$top" "${common[@]}" "${attention[@]}"
             --config.data.mqar.pairs="$pairs" --config.data.mqar.queries="$pairs"
             --config.data.seq_len="$(seq_len_of "$pairs")" --config.train.steps="$steps"
             --config.train.warmup_steps=$((steps / 20 > 0 ? steps / 20 : 1)) --config.train.log_every="$every"
             --config.train.eval_every="$every" --config.train.checkpoint_every="$every"
             ${previous:+--config.train.init_from="$previous"})
    { printf '%q ' "${command[@]}"; echo; } >> "$LOGS/commands_$arm.txt"
    CUDA_VISIBLE_DEVICES=$(gpu_of "$lane") XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION timeout -s TERM -k 20 "$share" "${command[@]}" \
      > "$log" 2>&1
    status=$?
    case $status in
      0) what="finished" ;;
      124) what="stopped at its time limit" ;;
      137) what="killed after its time limit" ;;
      *) what="FAILED" ;;
    esac
    say "train $arm $name ($steps steps${previous:+, from $(basename "$previous")}, at most ${share}s): exit status" \
      "$status ($what); eval loss $(eval_losses "$top"); last line: $(grep -v '^\s*$' "$log" | tail -1)"
    if [ "$what" = FAILED ]; then
      verdict="training FAILED in $name (exit status $status, logs/$(basename "$log"))"
      verdict+=": $(grep -v '^\s*$' "$log" | tail -1)"
      break
    fi
    if ! all_seeds_hold_a_checkpoint "$top"; then
      verdict="$name left a seed without a checkpoint ($what, logs/$(basename "$log")):"
      verdict+=" the stages after it were not run"
      break
    fi
    previous=$top
  done
  echo "$verdict" > "$LOGS/train_$arm.verdict"
}
say "training arms '$ARMS' with $SEEDS seeds each, stages of ${STAGES// /, } pairs," \
  "until $(left "$EVAL_RESERVE")s from now"
declare -A pids
lane=0
for arm in $ARMS; do
  train_arm "$arm" "$lane" &
  pids[$arm]=$!
  lane=$((lane + 1))
done
declare -A trouble  # arm -> what went wrong with it (said plainly at the end of summary.txt)
for arm in $ARMS; do
  wait "${pids[$arm]}"
  verdict=$(cat "$LOGS/train_$arm.verdict" 2> /dev/null || echo "its stages ended without a verdict")
  [ "$verdict" = ok ] || trouble[$arm]=$verdict
done

# The arms to score: in ARMS order, each arm whose last stage's seeds all hold a checkpoint step in
# common with each other and with the arms kept before it; all are scored at the newest step they all
# hold (arms stop at different steps). Printed: that step, then a line per arm: "<arm> keep" or
# "<arm> drop <why>".
decisions=$(JAX_PLATFORMS=cpu "$PY" - "$RUNS" "$last" "$SEEDS" $ARMS << 'EOF'
import os, sys
from castle_jax.eval.common_step import checkpoint_steps
runs, stage, seeds, arms = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:]
common, kept, lines = None, [], []
for arm in arms:
  held = [set(checkpoint_steps(os.path.join(runs, arm, stage, f"seed_{k}"))) for k in range(seeds)]
  empty = [str(k) for k, steps in enumerate(held) if not steps]
  shared = set.intersection(*held)
  if empty:
    which = f"seed {empty[0]} (of {seeds}) holds" if len(empty) == 1 else f"seeds {', '.join(empty)} (of {seeds}) hold"
    lines.append(f"{arm} drop {which} no checkpoint of {stage}")
  elif not shared:
    lines.append(f"{arm} drop its seeds hold no checkpoint step of {stage} in common")
  elif common is not None and not common & shared:
    lines.append(f"{arm} drop none of its checkpoint steps {sorted(shared)} is held by {' '.join(kept)}")
  else:
    common = shared if common is None else common & shared
    kept.append(arm)
    lines.append(f"{arm} keep")
print(max(common) if common else "none")
print("\n".join(lines))
EOF
)
step=$(head -1 <<< "$decisions")
kept=()
while read -r arm verdict why; do
  if [ "$verdict" = keep ]; then
    kept+=("$arm")
  else
    trouble[$arm]="${trouble[$arm]:+${trouble[$arm]}; }not scored: $why"
  fi
done < <(tail -n +2 <<< "$decisions")
if [ ${#kept[@]} = 0 ]; then
  say "ERROR: no arm has a checkpoint step of $last that all its seeds hold (logs/train_*.log)"
  for arm in $ARMS; do say "ARM $arm: ${trouble[$arm]:-}"; done
  exit 1
fi
budget=$(left 15)
say "scoring every seed of '${kept[*]}' ($last) at step $step on $EXAMPLES held-out prompts, at most ${budget}s"
declare -A scoring
lane=0
for arm in "${kept[@]}"; do
  for k in $(seq 0 $((SEEDS - 1))); do
    CUDA_VISIBLE_DEVICES=$(gpu_of "$lane") XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s TERM -k 5 "$budget" "$PY" -m castle_jax.eval.tasks \
      --workdir="$RUNS/$arm/$last/seed_$k" --step="$step" --examples="$EXAMPLES" > "$LOGS/tasks_${arm}_seed_$k.log" 2>&1 &
    scoring[$arm/$k]=$!
    lane=$((lane + 1))
  done
done
compared=()
for arm in "${kept[@]}"; do
  failed=()
  for k in $(seq 0 $((SEEDS - 1))); do wait "${scoring[$arm/$k]}" || failed+=("$k"); done
  if [ ${#failed[@]} = 0 ]; then
    compared+=("$arm")
    [ -n "${trouble[$arm]:-}" ] && trouble[$arm]+="; compared all the same, at step $step (all its seeds hold it)"
  else
    trouble[$arm]="${trouble[$arm]:+${trouble[$arm]}; }not compared: scoring failed for seed ${failed[*]} (logs/tasks_${arm}_seed_*.log)"
  fi
done
say "scoring: every seed scored for '${compared[*]}'"

for arm in $ARMS; do
  mkdir -p "$OUT/$arm"
  cp "$RUNS/$arm/$last/seeds.json" "$OUT/$arm/" 2> /dev/null
  for k in $(seq 0 $((SEEDS - 1))); do
    mkdir -p "$OUT/$arm/seed_$k"
    cp -r "$RUNS/$arm/$last/seed_$k/config.json" "$RUNS/$arm/$last/seed_$k/metrics.jsonl" \
      "$RUNS/$arm/$last/seed_$k/eval" "$OUT/$arm/seed_$k/" 2> /dev/null
    for ((i = 0; i < n; i++)); do
      name=$(stage_name "$i")
      [ -d "$RUNS/$arm/$name/seed_$k" ] || continue
      mkdir -p "$OUT/stages/$arm/$name/seed_$k"
      cp "$RUNS/$arm/$name/seed_$k/config.json" "$RUNS/$arm/$name/seed_$k/metrics.jsonl" \
        "$OUT/stages/$arm/$name/seed_$k/" 2> /dev/null
    done
  done
done
# Compared from inside OUT, so that the tables name the arms by their folder names.
root=$(pwd)
if [ ${#compared[@]} -gt 0 ]; then
  say "comparing '${compared[*]}' ($last) at step $step$([ ${#compared[@]} -gt 1 ] && echo " (differences to ${compared[0]})")"
  for metric in query_accuracy answer_loss; do
    (cd "$OUT" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu timeout 60 "$PY" -m castle_jax.eval.compare \
      "${compared[@]}" --results=tasks --metric="$metric" --output="compare_$metric") 2>&1 | tee -a "$OUT/summary.txt"
  done
  # Recall proper: the first query of each prompt, which elimination among the values already
  # answered cannot give (docs/reproduction.md).
  (cd "$OUT" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu timeout 60 "$PY" -m castle_jax.eval.compare \
    "${compared[@]}" --results=tasks --metric=query_accuracy --bucket=order:0 --output=compare_first_query) 2>&1 \
    | tee -a "$OUT/summary.txt"
fi
troubled=0
for arm in $ARMS; do
  if [ -n "${trouble[$arm]:-}" ]; then
    say "ARM $arm: ${trouble[$arm]}"
    troubled=$((troubled + 1))
  fi
done
say "done; results in $OUT"
# Success only when every arm trained every stage, was scored and was compared.
[ -d "$OUT/compare_query_accuracy" ] && [ "$troubled" = 0 ]
