#!/usr/bin/env bash
# The GPU tests (pytest -m gpu; they skip on a machine without CUDA), one part per 10-minute device call:
#   bash experiments/gpu_tests/run.sh one_gpu       skeleton, fused dispatcher at EP=1, host reads, trace breakdown,
#                                                   offload modes, forced routing, the loss, precision=fp8, FP8 copies
#                                                   following the optimizer (about 6 minutes on an H200)
#   bash experiments/gpu_tests/run.sh one_gpu_more  document masks, routing statistics, gradient accumulation, the
#                                                   planner's calibration, dispatcher.save, activation offload, FP8,
#                                                   determinism (the noise-band test alone runs several minutes)
#   bash experiments/gpu_tests/run.sh two_gpu   fused dispatcher at EP=2, distinct experts per EP rank
#   bash experiments/gpu_tests/run.sh four_gpu  fused dispatcher at EP=2 and EP=4 (nvidia-h200-x4)
# SELECT (a pytest -k expression) narrows a part, e.g. SELECT="not ep2 and not deterministic_gpu and not noise_band".
# Records: records/<machine>_1gpu|2gpu|4gpu/<UTC start>.log, headed by commit, GPU and command (see ../common.sh);
# each test's outcome is a line (-v), so a log cut by the call's limit still says which passed; with OUT set (a device
# call) the log is also written into $OUT as the tests run (../common.sh log_to), so it comes back when the call's own
# limit stops the part.
source "$(dirname "$0")/../common.sh"
case "${1:-}" in
one_gpu) log=$(record 1gpu).log limit=420 select="not expert_parallel"
         tests="tests/test_gpu_skeleton.py tests/test_fused_gpu.py tests/test_host_read.py tests/test_trace.py tests/test_offload.py tests/test_moe_layer.py tests/test_loss.py tests/test_precision.py tests/test_fp8_follows_step.py" ;;
one_gpu_more) log=$(record 1gpu).log limit=540 select="not ep2"
         tests="tests/test_tokens.py tests/test_routing.py tests/test_grad_accum.py tests/test_plan_calibrate.py tests/test_fused_save_gpu.py tests/test_activation_offload.py tests/test_fp8.py tests/test_determinism.py" ;;
two_gpu) log=$(record 2gpu).log limit=180 select="expert_parallel and ep2 or different_experts"
         tests="tests/test_fused_gpu.py tests/test_distributed_training.py" ;;
four_gpu) log=$(record 4gpu).log limit=300 select="expert_parallel or different_experts"
         tests="tests/test_fused_gpu.py tests/test_distributed_training.py" ;;
*) echo "usage: $0 one_gpu|one_gpu_more|two_gpu|four_gpu" >&2; exit 2 ;;
esac
command="python3 -m pytest -m gpu $tests -v -rs -p no:cacheprovider -k \"${SELECT:-$select}\""
{
  echo "# moe_lab commit ${MOE_LAB_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}$( [ "${MOE_LAB_GIT_DIRTY:-}" = 0 ] || git diff --quiet HEAD -- moe_lab tests 2>/dev/null || echo ' with local changes');" \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "# $command"
  timeout "$limit" bash -c "$command"
} 2>&1 | log_to "$log"
pack "$log"
