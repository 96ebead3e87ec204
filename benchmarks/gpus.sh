# Sourced by the benchmark scripts that spread their processes over GPUs (one lane per process).
# Sets GPU_IDS, the devices to use in order: CUDA_VISIBLE_DEVICES's list when it is set (a script
# started on some GPUs stays on them), else 0 .. n-1 for the n GPUs nvidia-smi lists (or for GPUS
# when it is given, so that lanes can be tested on a machine without GPUs); and GPUS, the number of
# lanes to spread over: as given, else the number of GPU_IDS. `gpu_of LANE` prints lane LANE's device
# (lanes wrap around GPUS). Exits with status 2 and one line for a GPUS that is not a count.
if [ -n "${GPUS:-}" ] && ! [[ $GPUS =~ ^[1-9][0-9]*$ ]]; then
  echo "ERROR: GPUS=$GPUS: pass a number of GPUs >= 1" >&2
  exit 2
fi
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a GPU_IDS <<< "$CUDA_VISIBLE_DEVICES"
else
  _listed=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
  [ "$_listed" -ge 1 ] 2> /dev/null || _listed=1
  read -r -a GPU_IDS <<< "$(seq -s ' ' 0 $(( (${GPUS:-0} > _listed ? ${GPUS:-0} : _listed) - 1 )))"
  unset _listed
fi
GPUS=${GPUS:-${#GPU_IDS[@]}}
gpu_of() { echo "${GPU_IDS[$(($1 % GPUS % ${#GPU_IDS[@]}))]}"; }
