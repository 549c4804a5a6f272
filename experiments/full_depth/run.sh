#!/usr/bin/env bash
# full_depth's runs on one H200, one part per call (each under a 10-minute device call; README.md says what they answer):
#   bash experiments/full_depth/run.sh seq16384    the points below at seq 16384 (estimated 9 minutes; stops itself at 9.5)
#   bash experiments/full_depth/run.sh seq32768    the points below at seq 32768 (estimated 10 minutes; stops itself at 9.5)
#   bash experiments/full_depth/run.sh gpu_tests   the GPU tests of dispatcher.save and ac.offload_activations (1 GPU)
#   bash experiments/full_depth/run.sh gpu_tests_ep2   dispatcher.save=inputs over symmetric memory (2 GPUs)
#   bash experiments/full_depth/run.sh loss        loss=chunked (the default) beside loss=full in one sitting: selective
#                                                  at 16384; at 32768 selective (save=rows) and save=inputs (about 7 min)
#   bash experiments/full_depth/run.sh gpu_tests_loss  the loss group's GPU test (tests/test_loss.py, 1 GPU)
# Overrides after a part go to every point (e.g. trainer.steps=5). A point runs once: one already recorded is skipped
# (delete its folder to run it again), so a part cut short resumes where it stopped when run again with its record's
# STAMP (e.g. STAMP=2026-12-01_22-36). POINT_NAMES="full save-inputs"
# runs only those points, in that order; LIMIT (seconds, default 570) bounds a part. Issue 43's seq 32768 sitting:
#   POINT_NAMES="full fp8_save-inputs fp8_save-inputs_keep-no-matmul save-inputs" bash experiments/full_depth/run.sh seq32768
# Records: records/<machine>_1gpu_seq<len>/<UTC start>/<point>/result.json (see ../common.sh); test logs .log.
source "$(dirname "$0")/../common.sh"

# point name -> its overrides (beside the preset: fused dispatcher, ac=selective, 48 layers, 16 experts)
POINTS=(
  "selective|ac=selective"
  "full|ac=full"
  "save-rows_only|ac=selective dispatcher.save=rows_only"
  "save-inputs|ac=selective dispatcher.save=inputs"
  "save-gate_up|ac=selective dispatcher.save=gate_up"
  "save-gate_up_keep-no-matmul|ac=selective dispatcher.save=gate_up ac.keep=[attention,router,dispatcher]"
  "keep-no-dispatcher|ac=selective ac.keep=[matmul,grouped_mm,attention,router]"
  "keep-no-matmul|ac=selective ac.keep=[attention,router,dispatcher]"
  "save-inputs_keep-no-matmul|ac=selective dispatcher.save=inputs ac.keep=[attention,router,dispatcher]"
  "save-inputs_offload|ac=selective dispatcher.save=inputs ac.offload_activations=true"
  "none_save-inputs_offload|ac=none dispatcher.save=inputs ac.offload_activations=true"
  "fp8_selective|ac=selective precision=fp8_experts"
  "fp8_save-inputs|ac=selective precision=fp8_experts dispatcher.save=inputs"
  "fp8_save-inputs_keep-no-matmul|ac=selective precision=fp8_experts dispatcher.save=inputs ac.keep=[attention,router,dispatcher]"
)

# loss=full beside the points above, which run the default loss=chunked (the loss part; issue 43)
LOSS_POINTS=(
  "selective_loss-full|ac=selective loss=full"
  "save-inputs_loss-full|ac=selective dispatcher.save=inputs loss=full"
)

overrides_of() {  # overrides_of NAME: the point's overrides, or a failure naming the points when there is none
  local point
  for point in "${POINTS[@]}" "${LOSS_POINTS[@]}"; do [ "${point%%|*}" = "$1" ] && { echo "${point#*|}"; return; }; done
  echo "full_depth: no point named '$1' (points: $(printf '%s ' "${POINTS[@]%%|*}"))" >&2; return 1
}

sweep() {  # sweep PRESET LABEL LIMIT_S OVERRIDES...: the points (POINT_NAMES or all), one process each, inside LIMIT_S s
  local preset=$1 dir end name overrides
  dir=$(record "$2")
  end=$((SECONDS + $3))
  for name in ${POINT_NAMES:-${POINTS[@]%%|*}}; do
    overrides=$(overrides_of "$name") || exit 2
    [ -f "$dir/$name/result.json" ] && continue
    [ $((end - SECONDS)) -gt 30 ] || { echo "full_depth: out of time before $name" >&2; break; }
    # shellcheck disable=SC2086  # the overrides are words
    timeout -k 20 $((end - SECONDS)) python3 -m moe_lab.train +experiment="$preset" $overrides "${@:4}" \
      hydra.run.dir="$dir/$name"
  done
  pack "$dir"
}

tests() {  # tests LABEL LIMIT_S SELECT [FILES]: GPU tests (by default this study's settings'), logged with commit and GPU
  local log command
  log=$(record "$1").log
  command="python3 -m pytest -m gpu ${4:-tests/test_fused_save_gpu.py tests/test_activation_offload.py} -q -rs -p no:cacheprovider -k \"$3\""
  {
    echo "# moe_lab commit $(git rev-parse HEAD 2>/dev/null || echo unknown), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "# $command"
    timeout "$2" bash -c "$command"
  } 2>&1 | log_to "$log"
  pack "$log"
}

case "${1:-}" in
seq16384) sweep full_depth 1gpu_seq16384 "${LIMIT:-570}" "${@:2}" ;;
seq32768) sweep full_depth/seq32768 1gpu_seq32768 "${LIMIT:-570}" "${@:2}" ;;
gpu_tests) tests 1gpu_tests 400 "not ep2" ;;
gpu_tests_ep2) tests 2gpu_tests 200 "ep2" ;;
loss)
  POINT_NAMES="selective selective_loss-full" sweep full_depth 1gpu_seq16384 "${LIMIT16:-220}" "${@:2}"
  POINT_NAMES="selective selective_loss-full save-inputs save-inputs_loss-full" \
    sweep full_depth/seq32768 1gpu_seq32768 "${LIMIT32:-340}" "${@:2}" ;;
gpu_tests_loss) tests 1gpu_tests_loss 300 "" "-s tests/test_loss.py" ;;
*) echo "usage: $0 seq16384|seq32768|gpu_tests|gpu_tests_ep2|loss|gpu_tests_loss" >&2; exit 2 ;;
esac
