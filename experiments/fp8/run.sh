#!/usr/bin/env bash
# FP8 experts (dispatcher.expert_precision=fp8) against bf16, one H200; one part per call (README.md says what each
# answers):
#   bash experiments/fp8/run.sh probe    DeepGEMM's FP8 API on this GPU: signatures, scale layouts, correctness, speed
#   bash experiments/fp8/run.sh layer    one MoE layer fwd+bwd, fused bf16 vs fused FP8: 30B and 235B shapes,
#                                        4k-16k tokens, balanced and skewed (records hold fp8_over_bf16)
#   bash experiments/fp8/run.sh e2e      training steps: the 4-layer 30B proxy and the 48-layer/16-expert share,
#                                        seq 16384, bf16 vs fp8 at each AC mode
#   bash experiments/fp8/run.sh quality  1000 steps on real text, learned routing + aux loss, bf16 vs fp8 curves
# Records: records/<machine>_<part>/<UTC start>.json|/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
case "${1:-}" in
probe) out=$(record probe).log && python3 experiments/fp8/probe.py 2>&1 | tee "$out" ;;
layer) out=$(record layer).json && timeout 420 python3 experiments/moe_layer/moe_layer.py --models=qwen3_30b,qwen3_235b \
         --tokens=4096,8192,16384 --routing=balanced,skewed --expert-precision=fp8 --dispatchers=fused,fused_fp8 \
         --iters=10 --profile --out "$out" ;;
*) echo "usage: $0 probe|layer|e2e|quality" >&2; exit 2 ;;
esac
pack "$out"
