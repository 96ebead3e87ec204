#!/usr/bin/env bash
# Passkey retrieval over several seeds of the tiny DRT recipe, against the random-retriever
# control, on one or more GPUs within a time budget (docs/reproduction.md, GCA / DRT):
#   1. stage 1, configs/drt_tiny_retrieval.py, SEEDS seeds vmapped in one process per GPU (each
#      GPU its share of the seeds: train.seed_indices, one workdir). It reads
#      every earlier chunk (top_k 17 of 17 chunks), where a learned and a random retriever
#      read the same set, so both arms share it;
#   2. stage 2, configs/drt_tiny_retrieval_topk.py from stage 1 (train.init_from: seed k from
#      seed k), both arms at once: retriever "learned" (the recipe) and "random" (the control:
#      top-4 drawn uniformly among the earlier chunks, GCA still learned); on one GPU a process
#      per arm, on several a process per (arm, seed) spread over them;
#   3. python -m castle_jax.eval.passkey --top_k=4 on every seed of both arms, every
#      (arm, seed) at once (spread over the GPUs), one process and one JSON per length;
#   4. a summary: per arm and length, how many seeds reach THRESHOLD all-digit accuracy.
# Each stage stops at its time limit (SIGTERM saves a checkpoint, the next stage starts from
# it) and the whole script ends by BUDGET_SECONDS, keeping what it has: metrics.jsonl and
# config.json of every seed and stage, one JSON per (arm, seed, length), logs, summary.json.
#
#   PYTHON=python3 OUT=results bash benchmarks/drt_seeds.sh [--config.key=value ...]
#       one GPU: BUDGET_SECONDS=525 (stage 1 STAGE1_SECONDS=285, stage 2 STAGE2_SECONDS=100,
#       the evaluations what is left, at least EVAL_SECONDS=130); checkpoints go to RUNS
#       (default runs/drt_seeds), which must not hold a previous run
#   SMOKE=1 OUT=/tmp/drt_seeds RUNS=/tmp/drt_seeds_runs bash benchmarks/drt_seeds.sh
#       any machine (CPU; 1.5-5 minutes on 2 cores): 2 seeds, 3 steps per stage, 1K-token
#       prompts; checks the plumbing only
#
# A stage-1 schedule longer than one call (the recipe's ~13,600 steps take about an hour): pass
# STAGES="1" and CONTINUE=1 with the same RUNS to each call but the last, which runs all of
# STAGES="1 2 eval" (the default). CONTINUE=1 resumes every stage from its newest checkpoint
# in RUNS (a finished stage returns at once) instead of refusing a RUNS that holds one; OUT must
# be new each call. On a machine that stays up between calls, RUNS can stay in place; else
# carry it (a checkpoint of the tiny model: 12 MB per seed with its optimizer state).
#
# GPUS: the GPUs to use (default: those of CUDA_VISIBLE_DEVICES, else those nvidia-smi lists; 1
# without one; benchmarks/gpus.sh). Stage 1 needs the same GPUS in every call of a chain (each
# process resumes its own seeds from their newest checkpoint).
#
# STAGE1_STEPS and STAGE2_STEPS are the schedules' lengths (default the recipe's: 16,000 and
# 5,000; the time limits usually stop the runs first, as the time limit stopped the run that
# produced the shipped model at step ~13,600). EVALS: length:examples pairs (all the prompts of
# a length in one batch, EVAL_BATCH caps it). Extra flags go to every training run.
set -u
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # kept valid after the cd below
OUT=$(realpath -m "${OUT:-runs/drt_seeds_results}")
RUNS=$(realpath -m "${RUNS:-runs/drt_seeds}")
cd "$(dirname "$0")/.." || exit 1  # the repository root: python -m train, configs/
SEEDS=${SEEDS:-4}
source benchmarks/gpus.sh  # GPU_IDS, GPUS, gpu_of
[[ $SEEDS =~ ^[1-9][0-9]*$ ]] || { echo "ERROR: SEEDS=$SEEDS: pass a number of seeds >= 1" >&2; exit 2; }
THRESHOLD=${THRESHOLD:-0.9}
START=$(date +%s)
if [ "${SMOKE:-0}" = 1 ]; then
  SEEDS=${SMOKE_SEEDS:-2}
  BUDGET_SECONDS=${BUDGET_SECONDS:-900} STAGE1_SECONDS=${STAGE1_SECONDS:-300} STAGE2_SECONDS=${STAGE2_SECONDS:-300}
  STAGE1_STEPS=${STAGE1_STEPS:-3} STAGE2_STEPS=${STAGE2_STEPS:-3}
  EVALS=${EVALS:-1024:2}
  small=(--config.data.batch_size=2 --config.train.eval_every=3 --config.train.eval_batches=1
         --config.train.checkpoint_every=3 --config.train.log_every=1)
  stage1_size=("${small[@]}" --config.data.seq_len=255)
  stage2_size=("${small[@]}" --config.data.seq_len=511)
else
  BUDGET_SECONDS=${BUDGET_SECONDS:-525} STAGE1_SECONDS=${STAGE1_SECONDS:-285} STAGE2_SECONDS=${STAGE2_SECONDS:-100}
  STAGE1_STEPS=${STAGE1_STEPS:-16000} STAGE2_STEPS=${STAGE2_STEPS:-5000}
  EVALS=${EVALS:-16384:20,131072:20,1048576:4}
  # Evaluations more often than the configs' 2,000 / 1,000 steps: the time limits stop the runs
  # between them (a stop saves a checkpoint before any evaluation).
  stage1_size=(--config.train.eval_every=1000) stage2_size=(--config.train.eval_every=250)
fi
EVAL_BATCH=${EVAL_BATCH:-20}
EVAL_SECONDS=${EVAL_SECONDS:-130}  # kept for the evaluations whatever the training stages take
ARMS="learned random"
STAGES=" ${STAGES:-1 2 eval} "
CONTINUE=${CONTINUE:-0}
for part in $STAGES; do
  case $part in 1 | 2 | eval) ;; *) echo "ERROR: STAGES: unknown part '$part' (choose among 1 2 eval)" >&2; exit 2 ;; esac
done
runs_in_use=("$RUNS/stage1" "$RUNS/stage2_learned" "$RUNS/stage2_random")
[ "$CONTINUE" = 1 ] && runs_in_use=()
for previous in "${runs_in_use[@]}" "$OUT/summary.json" "$OUT/passkey"; do
  if [ -e "$previous" ]; then
    echo "ERROR: $previous exists (a previous run): pass another RUNS= and OUT=, move it away, or CONTINUE=1 to resume its checkpoints" >&2
    exit 2
  fi
done
mkdir -p "$OUT/logs" "$OUT/passkey" "$RUNS"

left() {  # seconds until the budget ends, less a reserve (default 10 s for the summary)
  echo $(( BUDGET_SECONDS - ($(date +%s) - START) - ${1:-10} ))
}
limit() {  # the smaller of a stage's own limit and what the budget leaves after `reserve`
  local own=$1 reserve=$2 rest
  rest=$(left "$reserve")
  echo $(( own < rest ? own : rest ))
}
note() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/timeline.txt"; }
collect() {  # workdir name: keep each seed's metrics.jsonl and config.json under $OUT/name/
  local workdir=$1 name=$2 seed
  for seed in $(seq 0 $((SEEDS - 1))); do
    mkdir -p "$OUT/$name/seed_$seed"
    cp "$workdir/seed_$seed/metrics.jsonl" "$workdir/seed_$seed/config.json" "$OUT/$name/seed_$seed/" 2>/dev/null
  done
}
train_stage() {  # seconds workdir log lane config [flags...]: exit status 0 (done) or 124 (stopped at its limit)
  local seconds=$1 workdir=$2 log=$3 lane=$4 config=$5; shift 5
  if [ "$seconds" -lt 40 ]; then note "$(basename "$workdir"): no time left"; return 1; fi
  # SIGTERM saves the step in flight (every seed) and exits; KILL only if that hangs.
  CUDA_VISIBLE_DEVICES=$(gpu_of "$lane") timeout -k 15 -s TERM "$((seconds - 20))" "$PY" -m train --config="$config" \
      --workdir="$workdir" --config.train.seeds="$SEEDS" --config.train.progress_bar=False "$@" > "$OUT/logs/$log.log" 2>&1
  local status=$?
  note "$log: exit status $status (124: stopped at the time limit after saving)"
  tail -n 3 "$OUT/logs/$log.log"
  return "$status"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -n 1; } > "$OUT/device.txt"
note "start: $SEEDS seeds on $GPUS GPU(s), budget ${BUDGET_SECONDS}s, evals $EVALS"

wanted() { [[ $STAGES == *" $1 "* ]]; }
share_of() {  # share processes: the train.seed_indices flag of seeds share, share + processes, ... (none for one process)
  local share=$1 processes=$2 indices=()
  [ "$processes" -gt 1 ] || return 0
  for seed in $(seq "$share" "$processes" $((SEEDS - 1))); do indices+=("$seed"); done
  echo "--config.train.seed_indices=($(IFS=,; echo "${indices[*]}"),)"
}
later=0  # seconds kept for the parts after stage 1
wanted 2 && later=$((later + STAGE2_SECONDS))
wanted eval && later=$((later + EVAL_SECONDS))

# 1. Stage 1, shared by both arms. Each GPU holds one process (its seeds): most of its memory.
stage1=0
if wanted 1; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
  seconds=$(limit "$STAGE1_SECONDS" "$later")
  processes=$(( GPUS < SEEDS ? GPUS : SEEDS ))
  pids=()
  for lane in $(seq 0 $((processes - 1))); do
    log=stage1
    [ "$processes" -gt 1 ] && log=stage1_gpu$lane
    train_stage "$seconds" "$RUNS/stage1" "$log" "$lane" configs/drt_tiny_retrieval.py \
        --config.train.steps="$STAGE1_STEPS" $(share_of "$lane" "$processes") "${stage1_size[@]}" "$@" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do  # 0 if every process finished, 124 if one stopped at the limit, else its failure
    wait "$pid"
    status=$?
    if [ "$status" != 0 ] && { [ "$stage1" = 0 ] || [ "$stage1" = 124 ]; }; then stage1=$status; fi
  done
elif [ ! -d "$RUNS/stage1" ]; then
  stage1=1
  note "STAGES has no 1 and $RUNS/stage1 does not exist"
fi
collect "$RUNS/stage1" stage1

# 2. Stage 2, the two arms at once from the same stage-1 seeds.
if ! wanted 2; then
  note "stage 2 not in STAGES"
elif [ "$stage1" = 0 ] || [ "$stage1" = 124 ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
  seconds=$(limit "$STAGE2_SECONDS" "$EVAL_SECONDS")
  kwargs="'chunk_size': 31, 'top_k': 4, 'retrieval_groups': 1, 'encoder_layers': 1, 'gca_output': 'residual'"
  # One GPU: a process per arm, its seeds vmapped. Several: a process per (arm, seed), spread
  # over the GPUs (a tiny DRT's step of one seed is several times faster than its share of a
  # vmapped step of four).
  processes=1
  [ "$GPUS" -gt 1 ] && processes=$SEEDS
  lane=0
  for arm in $ARMS; do
    for share in $(seq 0 $((processes - 1))); do
      log=stage2_$arm
      [ "$processes" -gt 1 ] && log=stage2_${arm}_seed$share
      train_stage "$seconds" "$RUNS/stage2_$arm" "$log" "$lane" configs/drt_tiny_retrieval_topk.py \
          --config.train.init_from="$RUNS/stage1" --config.train.steps="$STAGE2_STEPS" $(share_of "$share" "$processes") \
          --config.model.family_kwargs="{$kwargs, 'retriever': '$arm'}" "${stage2_size[@]}" "$@" &
      lane=$((lane + 1))
    done
  done
  wait
  for arm in $ARMS; do collect "$RUNS/stage2_$arm" "stage2_$arm"; done
else
  note "stage 1 failed (exit status $stage1): no stage 2, no evaluation; see $OUT/logs/stage1*.log"
fi

# 3. Evaluation: one lane per (arm, seed), all at once; in a lane the lengths in order, each
#    length one process (a JSON per length survives a later length's time limit).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.08
evaluate_lane() {  # arm seed lane
  local arm=$1 seed=$2 lane=$3 pair length examples seconds workdir="$RUNS/stage2_$1/seed_$2"
  for pair in $(echo "$EVALS" | tr , ' '); do
    length=${pair%%:*} examples=${pair##*:}
    seconds=$(left)
    if [ "$seconds" -lt 20 ]; then note "eval $arm seed $seed length $length: no time left"; return; fi
    CUDA_VISIBLE_DEVICES=$(gpu_of "$lane") timeout -k 5 "$seconds" "$PY" -m castle_jax.eval.passkey --workdir="$workdir" --top_k=4 \
        --lengths="$length" --examples="$examples" --batch_size=$((examples < EVAL_BATCH ? examples : EVAL_BATCH)) \
        --output="$OUT/passkey/${arm}_seed${seed}_${length}.json" > "$OUT/logs/eval_${arm}_seed${seed}_${length}.log" 2>&1
    note "eval $arm seed $seed length $length: exit status $?"
  done
}
if wanted eval; then
  lane=0
  for arm in $ARMS; do
    for seed in $(seq 0 $((SEEDS - 1))); do
      [ -d "$RUNS/stage2_$arm/seed_$seed/checkpoints" ] && evaluate_lane "$arm" "$seed" "$lane" &
      lane=$((lane + 1))
    done
  done
  wait
fi

# 4. Summary (stdout and $OUT/summary.json).
note "summary"
"$PY" - "$OUT" "$SEEDS" "$THRESHOLD" "$ARMS" <<'EOF'
import glob
import json
import os
import re
import sys

from castle_jax.eval.compare import describe_difference, paired_difference

out, seeds, threshold, arms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split()


def records(path):
  found = {}
  if os.path.exists(path):
    for line in open(path):
      record = json.loads(line)
      found.setdefault(record["split"], {})[record["step"]] = record
  return found


def stage(name, seed):
  metrics = records(os.path.join(out, name, f"seed_{seed}", "metrics.jsonl"))
  train, evals = metrics.get("train", {}), metrics.get("eval", {})
  last_eval = evals[max(evals)] if evals else {}
  return {"steps": max(train, default=0), "eval_step": max(evals, default=None), "eval_loss": last_eval.get("loss")}


def loss(stage):
  return "-" if stage["eval_loss"] is None else f"{stage['eval_loss']:.3f} @{stage['eval_step']}"


passkey = {}
for path in glob.glob(os.path.join(out, "passkey", "*.json")):
  match = re.fullmatch(r"(\w+)_seed(\d+)_(\d+)\.json", os.path.basename(path))
  if match:
    for result in json.load(open(path))["results"]:
      key = (match[1], int(match[2]), result["length"])
      passkey[key] = {k: result[k] for k in ("first_token", "all_tokens", "examples", "seconds")}
lengths = sorted({length for _, _, length in passkey})
summary = {"threshold": threshold, "seeds": seeds, "arms": {}}
print(f"passkey accuracy, all digits (first digit), per seed; seeds with all-digit accuracy >= {threshold}")
for arm in arms:
  per_seed = []
  for seed in range(seeds):
    row = {"seed": seed, "stage1": stage("stage1", seed), "stage2": stage(f"stage2_{arm}", seed)}
    row["passkey"] = {str(length): passkey[(arm, seed, length)] for length in lengths if (arm, seed, length) in passkey}
    per_seed.append(row)
  passing = {
    str(length): sum(1 for row in per_seed if row["passkey"].get(str(length), {}).get("all_tokens", -1) >= threshold)
    for length in lengths
  }
  evaluated = {str(length): sum(1 for row in per_seed if str(length) in row["passkey"]) for length in lengths}
  summary["arms"][arm] = {"per_seed": per_seed, "seeds_passing": passing, "seeds_evaluated": evaluated}
  print(f"\n{arm}: stage-1 steps / last answer eval loss @step, the same for stage 2, then per length")
  for row in per_seed:
    s1, s2 = row["stage1"], row["stage2"]
    cells = [
      f"{length:>9,}: {r['all_tokens']:.2f} ({r['first_token']:.2f}) of {r['examples']}"
      if (r := row["passkey"].get(str(length)))
      else f"{length:>9,}: -"
      for length in lengths
    ]
    print(f"  seed {row['seed']}: {s1['steps']:>6} / {loss(s1)}  {s2['steps']:>5} / {loss(s2)}  " + "  ".join(cells))
  print("  seeds >= threshold: " + ", ".join(f"{n}: {passing[str(n)]} of {evaluated[str(n)]}" for n in lengths))

# random - learned, paired by seed (castle_jax.eval.compare's statistics): 95% t interval, paired t test.
per_arm = {arm: summary["arms"][arm]["per_seed"] for arm in arms}
values = {
  "stage-2 answer eval loss": lambda row: row["stage2"]["eval_loss"],
  **{
    f"all-digit accuracy at {length:,}": (lambda row, n=str(length): row["passkey"].get(n, {}).get("all_tokens"))
    for length in lengths
  },
}
summary["random_minus_learned"] = {}
print("\nrandom - learned, paired by seed: mean [95% interval], paired t test p")
for name, value in values.items():
  by_arm = [{row["seed"]: value(row) for row in per_arm[arm] if value(row) is not None} for arm in arms]
  if not set(by_arm[0]) & set(by_arm[1]):
    continue
  difference = paired_difference(*by_arm)
  summary["random_minus_learned"][name] = difference
  print(f"  {name}: {describe_difference(difference)} ({difference['n']} seeds)")
with open(os.path.join(out, "summary.json"), "w") as f:
  json.dump(summary, f, indent=1)
EOF
note "done"
