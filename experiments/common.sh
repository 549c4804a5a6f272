# Sourced by every experiments/<study>/run.sh: the settings of every GPU run and where its records go.
#   MACHINE  the records' machine label (default: the GPU's model from nvidia-smi, lower case: h200)
#   OUT      on a device machine, the folder that comes back: each run.sh also packs the records it made into
#            $OUT/<study>-<records folder>-<stamp>.tgz (traces left out); unpack with `tar -xzf <file>` in the checkout's root
set -uo pipefail
STUDY=$(basename "$(dirname "$(realpath "$0")")")  # the calling run.sh's folder (before the cd: $0 may be relative)
cd "$(dirname "${BASH_SOURCE[0]}")/.."  # the checkout's root: records land in experiments/<study>/records/
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
STAMP=${STAMP:-$(date -u +%Y-%m-%d_%H-%M)}  # a record's name: the UTC minute its run started (set it to resume one)
MACHINE=${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | awk '{print tolower($2)}')}
MACHINE=${MACHINE:-cpu}

record() {  # record LABEL: this run's record path (no extension) under the study's records/MACHINE_LABEL/
  mkdir -p "experiments/$STUDY/records/${MACHINE}_$1"
  echo "experiments/$STUDY/records/${MACHINE}_$1/$STAMP"
}

pack() {  # pack PATH...: with OUT set, these records as $OUT/STUDY-LABEL-NAME.tgz (the first path's folder and name:
  # two parts packed in one minute do not overwrite each other), paths from the checkout's root
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  tar -czf "$OUT/$STUDY-$(basename "$(dirname "$1")")-$(basename "$1" .json).tgz" --exclude='trace_rank*' "$@"
}

log_to() {  # log_to LOG: standard input into LOG and, with OUT set, into $OUT/STUDY-LABEL-NAME as it comes (a device
  # call cut by its own limit still brings back what ran; pack afterwards brings the finished LOG)
  [ -z "${OUT:-}" ] || mkdir -p "$OUT"
  tee ${OUT:+"$OUT/$STUDY-$(basename "$(dirname "$1")")-$(basename "$1")"} > "$1"
}

run_parts() {  # run_parts PART... [key=value...]: the study's run_part for each PART with the overrides after them,
  # then its records (the study's dirs array) packed
  local parts=() p
  while [ $# -gt 0 ] && [[ "$1" != *=* ]]; do parts+=("$1"); shift; done
  [ ${#parts[@]} -gt 0 ] || run_part usage
  for p in "${parts[@]}"; do run_part "$p" "$@"; done
  pack "${dirs[@]}"
}
