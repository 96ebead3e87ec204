#!/usr/bin/env bash
# Can the retrieval path alone learn to copy? Passkey prompts trained from scratch, where
# the decoder's window is too short to reach the needle, so only GCA over retrieved chunks
# can carry the passkey to the answer. Variants (configs/drt_tiny_passkey.py):
#   swa_full       sliding-window baseline whose window covers the whole prompt (the ceiling)
#   swa_short      the same with the DRT's short window (chance: the needle is out of reach)
#   drt            DRT, top-k of the chunks, the authors' block (GCA output into the MLP input)
#   drt_all        DRT retrieving every earlier chunk (retrieval selection cannot fail)
#   drt_res        DRT with the GCA output also added to the residual stream
#   drt_all_res    both
#   drt_nogumbel   DRT without Gumbel noise in the top-k
# All run at once on one GPU (each a small slice of its memory) and print the answer loss
# (chance: ln 10 = 2.30) per evaluation; metrics.jsonl per run under $OUT.
#
#   PYTHON=python3 OUT=results STEPS=3000 SEQ_LEN=511 WINDOW=8 TOP_K=4 \
#   VARIANTS="swa_full drt drt_all" bash benchmarks/drt_retrieval_ablation.sh [--config.key=value ...]
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-runs/drt_retrieval_ablation}
RUNS=${RUNS:-runs/drt_retrieval_ablation_runs}
STEPS=${STEPS:-3000}
SEQ_LEN=${SEQ_LEN:-511}
WINDOW=${WINDOW:-8}
TOP_K=${TOP_K:-4}
VARIANTS=${VARIANTS:-swa_full swa_short drt drt_all drt_res drt_all_res drt_nogumbel}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-900}
mkdir -p "$OUT" "$RUNS"
chunks=$(( (SEQ_LEN + 30) / 31 ))
common=(--config.data.seq_len="$SEQ_LEN" --config.data.batch_size=32 --config.train.steps="$STEPS"
        --config.train.warmup_steps=50 --config.train.learning_rate=2e-3 --config.train.eval_every=$((STEPS / 6))
        --config.train.eval_batches=8 --config.train.checkpoint_every="$STEPS" --config.train.progress_bar=False)
drt_kwargs() {  # top_k gumbel gca_output
  echo "--config.model.family_kwargs={'chunk_size': 31, 'top_k': $1, 'retrieval_groups': 1, 'encoder_layers': 1, 'gumbel': $2, 'gca_output': '$3'}"
}
run() {  # name config [flags...]
  local name=$1 config=$2; shift 2
  rm -rf "$RUNS/$name"
  timeout -s TERM "$SECONDS_PER_RUN" "$PY" -m train --config="$config" --workdir="$RUNS/$name" \
      "${common[@]}" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit status $?"
  cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.1}
for variant in $VARIANTS; do
  case $variant in
    swa_full) run swa_full configs/swa_tiny_passkey.py --config.model.sliding_window="$((SEQ_LEN + 1))" "$@" & ;;
    swa_short) run swa_short configs/swa_tiny_passkey.py --config.model.sliding_window="$WINDOW" "$@" & ;;
    drt) run drt configs/drt_tiny_passkey.py --config.model.sliding_window="$WINDOW" \
        "$(drt_kwargs "$TOP_K" True mlp_input)" "$@" & ;;
    drt_all) run drt_all configs/drt_tiny_passkey.py --config.model.sliding_window="$WINDOW" \
        "$(drt_kwargs "$chunks" True mlp_input)" "$@" & ;;
    drt_res) run drt_res configs/drt_tiny_passkey.py --config.model.sliding_window="$WINDOW" \
        "$(drt_kwargs "$TOP_K" True residual)" "$@" & ;;
    drt_all_res) run drt_all_res configs/drt_tiny_passkey.py --config.model.sliding_window="$WINDOW" \
        "$(drt_kwargs "$chunks" True residual)" "$@" & ;;
    drt_nogumbel) run drt_nogumbel configs/drt_tiny_passkey.py --config.model.sliding_window="$WINDOW" \
        "$(drt_kwargs "$TOP_K" False mlp_input)" "$@" & ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
done
wait
"$PY" - "$OUT" $VARIANTS <<'EOF'
import os, sys
from train.metrics import read_metrics
out, names = sys.argv[1], sys.argv[2:]
print(f"answer loss on eval batches (chance 2.30), by step")
rows = {}
for name in names:
  path = os.path.join(out, f"{name}.metrics.jsonl")
  rows[name] = ({step: r["loss"] for step, r in read_metrics(path, split="eval").items()}
                if os.path.exists(path) else {})
steps = sorted({s for r in rows.values() for s in r})
print(f"{'variant':14s}" + "".join(f"{s:>8d}" for s in steps))
for name, losses in rows.items():
  print(f"{name:14s}" + "".join(f"{losses[s]:8.3f}" if s in losses else f"{'-':>8s}" for s in steps))
EOF
