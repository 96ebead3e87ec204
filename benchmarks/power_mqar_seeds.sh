#!/usr/bin/env bash
# Does a larger power-attention state recall more? Multi-query associative recall (docs/tasks.md)
# with gated power attention at p = 2 and p = 4 (this library takes even powers only: the weights
# must be positive to be normalized, so p = 1 does not exist here). With heads of 8, a p = 2 head keeps
# D = C(9, 2) = 36 expanded keys (324 numbers with the normalizer), about as many as the 32 pairs of a
# prompt; p = 4 keeps D = C(11, 4) = 330 (2,970 numbers), near full attention's KV cache at the end of
# the 201-token prompt (3,216 numbers per head). Full softmax attention (`mha`) runs beside them as the
# check that the task is learnable at this budget. Each arm: SEEDS vmapped seeds, trained at once as
# separate processes sharing the GPU; then every seed is scored at the newest checkpoint step all seeds
# hold, on 1000 held-out prompts (castle_jax.eval.tasks), and castle_jax.eval.compare puts the arms side
# by side (query accuracy and answer loss, paired by seed, differences to p = 2).
#
#   OUT=results bash benchmarks/power_mqar_seeds.sh
#   SMOKE=1 OUT=/tmp/mqar_smoke bash benchmarks/power_mqar_seeds.sh      # tiny shapes on a CPU
#
# Settings (environment): PYTHON (python3), OUT (runs/power_mqar_seeds; must not hold results yet),
# RUNS (checkpoints; default a new folder under /tmp), SEEDS (3), STEPS (3000), PAIRS (32), QUERIES (8),
# HEAD_DIM (8), LAYOUT (data.mqar.layout: colon, " d:4", or compact, "d4"), ARMS ("p2 p4 mha"; the
# first is the base of the differences), DEADLINE (seconds after the start by which everything has
# ended: 510), EVAL_RESERVE (seconds kept for scoring: 90),
# EXAMPLES (1000), MEM_FRACTION (each training process's share of the GPU memory: 0.2; the scoring
# processes, one per seed, allocate what they use).
# Power attention runs its attention form (implementation "reference": the same function as the
# recurrent state, exact for any p, and cheap at 201 tokens); softmax attention runs on XLA; float32.
# Written to OUT: <arm>/seeds.json, <arm>/seed_<k>/{config.json,metrics.jsonl,eval/*.json},
# compare_query_accuracy/, compare_answer_loss/ and compare_first_query/ (the first query's accuracy,
# which elimination cannot give; castle_jax.eval.compare), logs/, summary.txt.
# An arm that fails does not sink the others: the arms scored are those whose seeds all hold a
# checkpoint step that the arms kept before them (in ARMS order) hold too, and those of them whose
# every seed was scored are compared (differences to the first of them). summary.txt ends with a line
# "ARM <arm>: ..." for each arm whose training failed (with its log's last line) or that was left out
# of the scoring or the comparison, and why. Exit status 0 only when every arm trained, was scored and
# was compared.
set -u
start=$SECONDS
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # kept valid after the cd below
SMOKE=${SMOKE:-0}
OUT=$(realpath -m "${OUT:-runs/power_mqar_seeds}")
cd "$(dirname "$0")/.." || exit 1  # the repository root: python -m train, configs/
RUNS=${RUNS:-}
ARMS=${ARMS:-p2 p4 mha}
MEM_FRACTION=${MEM_FRACTION:-0.2}
if [ "$SMOKE" = 1 ]; then
  SEEDS=${SEEDS:-2}
  STEPS=${STEPS:-4}
  PAIRS=${PAIRS:-8}
  QUERIES=${QUERIES:-2}
  EXAMPLES=${EXAMPLES:-32}
  DEADLINE=${DEADLINE:-900}
  EVAL_RESERVE=${EVAL_RESERVE:-300}
  BATCH=4
else
  SEEDS=${SEEDS:-3}
  STEPS=${STEPS:-3000}
  PAIRS=${PAIRS:-32}
  QUERIES=${QUERIES:-8}
  EXAMPLES=${EXAMPLES:-1000}
  DEADLINE=${DEADLINE:-510}
  EVAL_RESERVE=${EVAL_RESERVE:-90}
  BATCH=64
fi
HEAD_DIM=${HEAD_DIM:-8}
LAYOUT=${LAYOUT:-colon}
# A key takes 1 byte (a..z), 2 (aa..zz) or 3 (aaa..zzz), then a digit; "colon" adds a space and ":".
item=$((PAIRS > 702 ? 4 : PAIRS > 26 ? 3 : 2))
[ "$LAYOUT" = compact ] || item=$((item + 2))
SEQ_LEN=$((1 + (PAIRS + QUERIES) * item))
every=$((STEPS / 5 > 0 ? STEPS / 5 : 1))

case $LAYOUT in colon | compact) ;; *) echo "ERROR: LAYOUT must be colon or compact, got '$LAYOUT'" >&2; exit 2 ;; esac
for arm in $ARMS; do
  case $arm in p2 | p4 | mha) ;; *) echo "ERROR: ARMS: unknown arm '$arm'; choose from p2 p4 mha" >&2; exit 2 ;; esac
done
if [ -e "$OUT/summary.txt" ] || [ -e "$OUT/logs" ]; then
  echo "ERROR: OUT=$OUT holds the results of an earlier run (never replaced); pass a new OUT" >&2
  exit 2
fi
[ -n "$RUNS" ] || RUNS=$(mktemp -d /tmp/power_mqar_runs.XXXXXX)
mkdir -p "$OUT/logs" "$RUNS"
LOGS=$OUT/logs
left() { echo $((DEADLINE - (SECONDS - start) - $1)); }
say() { echo "[$((SECONDS - start))s] $*" | tee -a "$OUT/summary.txt"; }
say "commit $(git rev-parse HEAD 2>/dev/null || echo unknown); SMOKE=$SMOKE SEEDS=$SEEDS STEPS=$STEPS PAIRS=$PAIRS" \
  "QUERIES=$QUERIES HEAD_DIM=$HEAD_DIM LAYOUT=$LAYOUT SEQ_LEN=$SEQ_LEN EXAMPLES=$EXAMPLES RUNS=$RUNS" \
  "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"

width=$((SMOKE == 1 ? 2 * HEAD_DIM : 8 * HEAD_DIM))
common=(--config=configs/tasks_mqar_tiny.py --config.train.seeds="$SEEDS" --config.model.n_layers=2
        --config.model.d_model="$width" --config.model.n_heads=$((width / HEAD_DIM)) --config.model.head_dim="$HEAD_DIM"
        --config.data.mqar.pairs="$PAIRS" --config.data.mqar.key_vocab="$PAIRS" --config.data.mqar.queries="$QUERIES"
        --config.data.mqar.layout="$LAYOUT"
        --config.data.seq_len="$SEQ_LEN" --config.data.batch_size="$BATCH" --config.train.steps="$STEPS"
        --config.train.warmup_steps=$((STEPS / 20 > 0 ? STEPS / 20 : 1)) --config.train.log_every="$every"
        --config.train.eval_every="$every" --config.train.eval_batches=4 --config.train.checkpoint_every="$every"
        --config.train.keep_checkpoints=10 --config.train.progress_bar=False)
budget=$(left "$EVAL_RESERVE")
say "training arms '$ARMS' with $SEEDS seeds each, at most ${budget}s"
declare -A pids
for arm in $ARMS; do
  case $arm in
    p2 | p4) attention=(--config.model.attention=power "--config.model.attention_kwargs={'p': ${arm#p}}"
                        --config.model.attention_impl=reference) ;;
    mha) attention=(--config.model.attention_impl=xla) ;;
  esac
  command=("$PY" -m train --workdir="$RUNS/$arm" "${common[@]}" "${attention[@]}")
  printf '%q ' "${command[@]}" >> "$LOGS/commands.txt"
  echo >> "$LOGS/commands.txt"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$MEM_FRACTION timeout -s TERM -k 20 "$budget" "${command[@]}" \
    > "$LOGS/train_$arm.log" 2>&1 &
  pids[$arm]=$!
done
declare -A trouble  # arm -> what went wrong with it (said plainly at the end of summary.txt)
for arm in $ARMS; do
  wait "${pids[$arm]}"
  status=$?
  case $status in 0) what="finished" ;; 124) what="stopped at the time limit" ;; 137) what="killed after the time limit" ;; *) what="FAILED" ;; esac
  last=$(grep -v '^\s*$' "$LOGS/train_$arm.log" | tail -1)
  say "train $arm: exit status $status ($what); last line: $last"
  [ "$what" = FAILED ] && trouble[$arm]="training FAILED (exit status $status, logs/train_$arm.log): $last"
done

# The arms to score: in ARMS order, each arm whose seeds all hold a checkpoint step in common with
# each other and with the arms kept before it; all are scored at the newest step they all hold (arms
# stop at different steps). Printed: that step, then a line per arm: "<arm> keep" or "<arm> drop <why>".
decisions=$("$PY" - "$RUNS" "$SEEDS" $ARMS << 'EOF'
import os, re, sys
runs, seeds, arms = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
common, kept, lines = None, [], []
for arm in arms:
  held = []
  for k in range(seeds):
    directory = os.path.join(runs, arm, f"seed_{k}", "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    held.append({int(n) for n in names if re.fullmatch(r"[0-9]+", n)})
  empty = [str(k) for k, steps in enumerate(held) if not steps]
  shared = set.intersection(*held)
  if empty:
    which = f"seed {empty[0]} (of {seeds}) holds" if len(empty) == 1 else f"seeds {', '.join(empty)} (of {seeds}) hold"
    lines.append(f"{arm} drop {which} no checkpoint")
  elif not shared:
    lines.append(f"{arm} drop its seeds hold no checkpoint step in common")
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
  say "ERROR: no arm has a checkpoint step that all its seeds hold (logs/train_*.log)"
  for arm in $ARMS; do say "ARM $arm: ${trouble[$arm]:-}"; done
  exit 1
fi
budget=$(left 15)
say "scoring every seed of '${kept[*]}' at step $step on $EXAMPLES held-out prompts, at most ${budget}s"
declare -A scoring
for arm in "${kept[@]}"; do
  for k in $(seq 0 $((SEEDS - 1))); do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s TERM -k 5 "$budget" "$PY" -m castle_jax.eval.tasks \
      --workdir="$RUNS/$arm/seed_$k" --step="$step" --examples="$EXAMPLES" > "$LOGS/tasks_${arm}_seed_$k.log" 2>&1 &
    scoring[$arm/$k]=$!
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
  cp "$RUNS/$arm/seeds.json" "$OUT/$arm/" 2> /dev/null
  for k in $(seq 0 $((SEEDS - 1))); do
    mkdir -p "$OUT/$arm/seed_$k"
    cp -r "$RUNS/$arm/seed_$k/config.json" "$RUNS/$arm/seed_$k/metrics.jsonl" "$RUNS/$arm/seed_$k/eval" \
      "$OUT/$arm/seed_$k/" 2> /dev/null
  done
done
# Compared from inside OUT, so that the tables name the arms by their folder names.
root=$(pwd)
if [ ${#compared[@]} -gt 0 ]; then
  say "comparing '${compared[*]}' at step $step$([ ${#compared[@]} -gt 1 ] && echo " (differences to ${compared[0]})")"
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
# Success only when every arm trained, was scored and was compared.
[ -d "$OUT/compare_query_accuracy" ] && [ "$troubled" = 0 ]
