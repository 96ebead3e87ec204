#!/usr/bin/env bash
# CASTLE against standard attention on variable tracking with overwrites (docs/tasks.md,
# docs/reproduction.md#castle-variable-tracking-with-overwrites): each arm trains SEEDS vmapped
# seeds ALONE on the GPU, one arm after another (processes that share a GPU slice it in time, and
# small models then run several times slower in total), stopped at ARM_SECONDS (a stopped run saves
# its step); then every seed is scored on held-out prompts (castle_jax.eval.tasks, accuracy by
# overwrite count) and castle_jax.eval.compare puts the arms side by side, paired by seed.
#
#   OUT=results bash benchmarks/variable_tracking_seeds.sh
#   ARMS="castle_4_heads control_mha_4_heads" OUT=results2 bash benchmarks/variable_tracking_seeds.sh
#   SMOKE=1 OUT=/tmp/vt_smoke bash benchmarks/variable_tracking_seeds.sh     # tiny, on a CPU
#
# Arms: mha_4_heads (the baseline), castle_2_heads (parameter parity), castle_4_heads (the
# baseline's heads), castle_swl_2_heads (CASTLE-SWL at parameter parity, lookahead window 16),
# and control_<arm> for each: the same statements with no overwrite (twice the names, each
# assigned once). Settings (environment): PYTHON (python3), OUT (must not hold results),
# RUNS (checkpoints; default a new folder under /tmp), ARMS ("mha_4_heads castle_2_heads"), SEEDS (5),
# STEPS (20000: the cosine schedule's length), ARM_SECONDS (250), WORKERS (data worker processes per
# seed: 3), EXAMPLES (scored prompts per seed: 400), SOLVED (query accuracy from which a seed's workdir
# is kept in OUT/solved/<arm>/: 0.9). Each arm's best seed is also exported as a package asset
# (OUT/pretrained/variable_tracking_<arm>.config.json and .npz; castle_jax.models.pretrained).
set -u
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
OUT=$(realpath -m "${OUT:-runs/variable_tracking_seeds}")
cd "$(dirname "$0")/.." || exit 1
ARMS=${ARMS:-mha_4_heads castle_2_heads}
if [ "${SMOKE:-0}" = 1 ]; then
  SEEDS=${SEEDS:-2} STEPS=${STEPS:-6} ARM_SECONDS=${ARM_SECONDS:-300} WORKERS=${WORKERS:-0} EXAMPLES=${EXAMPLES:-16}
  shape=(--config.data.batch_size=4 --config.train.eval_every=3 --config.train.log_every=3 --config.train.eval_batches=1)
else
  SEEDS=${SEEDS:-5} STEPS=${STEPS:-20000} ARM_SECONDS=${ARM_SECONDS:-250} WORKERS=${WORKERS:-3} EXAMPLES=${EXAMPLES:-400}
  shape=(--config.data.batch_size=128 --config.train.eval_every=1000 --config.train.log_every=1000 --config.train.eval_batches=4)
fi
if [ -e "$OUT/summary.txt" ]; then
  echo "ERROR: OUT=$OUT holds the results of an earlier run (never replaced); pass a new OUT" >&2
  exit 2
fi
SOLVED=${SOLVED:-0.9}
RUNS=${RUNS:-$(mktemp -d /tmp/variable_tracking_runs.XXXXXX)}
mkdir -p "$OUT/logs" "$RUNS"
say() { echo "[${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
common=(--config=configs/tasks_variable_tracking_tiny.py --config.model.attention_impl=xla
        --config.train.seeds="$SEEDS" --config.data.worker_count="$WORKERS" --config.train.steps="$STEPS"
        --config.train.warmup_steps=200 --config.train.checkpoint_every="$STEPS" --config.train.progress_bar=False
        --config.data.seq_len=60 --config.data.variable_tracking.assignments=8
        --config.data.variable_tracking.queries=4 "${shape[@]}")
for arm in $ARMS; do
  base=${arm#control_}
  case $base in
    mha_4_heads) model=() ;;
    castle_2_heads) model=(--config.model.attention=castle --config.model.n_heads=2 --config.model.head_dim=32) ;;
    castle_4_heads) model=(--config.model.attention=castle) ;;
    # CASTLE-SWL at parameter parity, lookahead keys over the last 16 tokens (the prompts are 60).
    castle_swl_2_heads) model=(--config.model.attention=castle_swl --config.model.n_heads=2 --config.model.head_dim=32
                               "--config.model.attention_kwargs={'lookahead_window': 16}") ;;
    *) say "ERROR: unknown arm '$arm' (mha_4_heads, castle_2_heads, castle_4_heads, castle_swl_2_heads, control_<one of them>)"; exit 2 ;;
  esac
  if [ "$arm" = "$base" ]; then
    task=(--config.data.variable_tracking.names=4)
  else
    task=(--config.data.variable_tracking.names=8 --config.data.variable_tracking.overwrite_rate=0)
  fi
  command=("$PY" -m train "${common[@]}" "${model[@]}" "${task[@]}" --workdir="$RUNS/$arm")
  echo "${command[*]}" >> "$OUT/logs/commands.txt"
  timeout -s TERM -k 30 "$ARM_SECONDS" "${command[@]}" > "$OUT/logs/train_$arm.log" 2>&1
  say "train $arm: exit status $? (124: stopped at the time limit); $(grep -E '^step +[0-9]+ \| loss' "$OUT/logs/train_$arm.log" | tail -1)"
done
for arm in $ARMS; do
  for ((k = 0; k < SEEDS; k++)); do
    XLA_PYTHON_CLIENT_PREALLOCATE=false "$PY" -m castle_jax.eval.tasks --workdir="$RUNS/$arm/seed_$k" \
      --examples="$EXAMPLES" > "$OUT/logs/tasks_${arm}_$k.log" 2>&1 &
  done
  wait
  accuracies=()
  for ((k = 0; k < SEEDS; k++)); do
    accuracies[k]=$(sed -n 's/.*query accuracy \([0-9.]*\).*/\1/p' "$OUT/logs/tasks_${arm}_$k.log" | head -1)
  done
  say "$arm: ${accuracies[*]}"
  # A seed that solved the task keeps its workdir (config and last checkpoint) in OUT, for
  # python -m castle_jax.models.export_pretrained.
  for ((k = 0; k < SEEDS; k++)); do
    accuracy=${accuracies[k]}
    if [ -n "$accuracy" ] && awk -v a="$accuracy" -v t="$SOLVED" 'BEGIN { exit !(a >= t) }'; then
      mkdir -p "$OUT/solved/$arm"
      cp -r "$RUNS/$arm/seed_$k" "$OUT/solved/$arm/" && rm -rf "$OUT/solved/$arm/seed_$k/tensorboard"
      say "$arm seed $k solved the task (query accuracy $accuracy >= $SOLVED): its workdir is in $OUT/solved/$arm/seed_$k"
    fi
  done
  # The arm's best seed, solved or not, as a package asset (config + float16 parameters) in
  # OUT/pretrained/variable_tracking_<arm>.*, what castle_jax/assets ships.
  best=$(for ((k = 0; k < SEEDS; k++)); do echo "${accuracies[k]:--1} $k"; done | sort -g -r | head -1 | cut -d' ' -f2)
  if [ -n "${accuracies[best]}" ]; then
    "$PY" -m castle_jax.models.export_pretrained --workdir="$RUNS/$arm/seed_$best" --name="variable_tracking_$arm" \
      --out_dir="$OUT/pretrained" > "$OUT/logs/export_$arm.log" 2>&1
    say "$arm: best seed $best (query accuracy ${accuracies[best]}) exported to $OUT/pretrained: exit status $?"
  fi
done
# The control's prompts differ from the task's, so each group is compared on its own.
for group in task control; do
  if [ $group = task ]; then arms=$(tr ' ' '\n' <<< "$ARMS" | grep -v '^control_'); else arms=$(tr ' ' '\n' <<< "$ARMS" | grep '^control_'); fi
  [ "$(wc -w <<< "$arms")" -ge 2 ] || continue
  (cd "$RUNS" && "$PY" -m castle_jax.eval.compare $arms --output="$OUT/compare_$group" > "$OUT/logs/compare_$group.log" 2>&1)
  tail -n 12 "$OUT/logs/compare_$group.log" | tee -a "$OUT/summary.txt"
done
# Per-seed metrics and scores (no checkpoints) beside the logs.
(cd "$RUNS" && find . -name checkpoints -prune -o -name tensorboard -prune -o -type f -print | tar czf "$OUT/runs.tgz" -T -)
say "done"
