#!/usr/bin/env bash
# One MoE layer forward+backward, torch dispatcher vs fused (experiments/moe_layer/moe_layer.py), one part per call:
#   bash experiments/moe_layer/run.sh ep1   one GPU: 30B and 235B shapes, 4k-16k tokens, balanced and skewed routing
#   bash experiments/moe_layer/run.sh ep2   two GPUs (EP=2): 8k and 16k tokens per GPU
#   bash experiments/moe_layer/run.sh ep4   four GPUs (EP=4, nvidia-h200-x4): the same
# Records: records/<machine>_ep1|ep2|ep4/<UTC start>.json (see ../common.sh).
source "$(dirname "$0")/../common.sh"
case "${1:-}" in
ep1) out=$(record ep1).json && timeout 300 python3 experiments/moe_layer/moe_layer.py --models=qwen3_30b,qwen3_235b \
       --tokens=4096,8192,16384 --routing=balanced,skewed --gemm=auto --iters=10 --profile --out "$out" ;;
ep2|ep4) out=$(record "$1").json && timeout 240 torchrun --nproc_per_node "${1#ep}" experiments/moe_layer/moe_layer.py --gemm auto \
       --tokens 8192,16384 --out "$out" ;;
*) echo "usage: $0 ep1|ep2|ep4" >&2; exit 2 ;;
esac
pack "$out"
