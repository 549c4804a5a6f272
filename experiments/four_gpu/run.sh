#!/usr/bin/env bash
# four_gpu's runs on one node of 4 GPUs (nvidia-h200-x4), one part per 10-minute device call (README.md says what
# they answer):
#   bash experiments/four_gpu/run.sh 30b [balanced|skewed]    30B proxy: dispatcher x ac, one routing (default balanced)
#   bash experiments/four_gpu/run.sh 235b [balanced|skewed]   235B proxy (4 layers): the same
#   bash experiments/four_gpu/run.sh offload                  30B proxy, fused + selective: offload x grad_accum 1, 8
#   bash experiments/four_gpu/run.sh full_depth               all 48 layers of Qwen3-30B-A3B under each offload mode
# With them, on the same machine: experiments/torchtitan_baseline/run.sh four_gpu|four_gpu_235b,
# experiments/moe_layer/run.sh ep4, experiments/gpu_tests/run.sh four_gpu.
# Overrides after the part narrow the sweep. Records: records/<machine>_4gpu[_235b]/<UTC start>_<part>/ (../common.sh).
source "$(dirname "$0")/../common.sh"
sweep() {  # sweep LABEL PRESET OVERRIDES...
  dir=$(record "$1")_$part
  timeout -k 30 520 python3 -m moe_lab.train -m +experiment="$2" hydra.sweep.dir="$dir" "${@:3}"
}
part=${1:-}
case "$part" in
30b) sweep 4gpu four_gpu model.routing="${2:-balanced}" "${@:3}" ;;
235b) sweep 4gpu_235b four_gpu/235b model.routing="${2:-balanced}" "${@:3}" ;;
offload) sweep 4gpu four_gpu dispatcher=fused ac=selective model.routing=balanced offload=none,optimizer,full \
           trainer.grad_accum=8,1 "${@:2}" ;;
full_depth) sweep 4gpu four_gpu dispatcher=fused ac=selective model.routing=balanced model.num_layers=48 \
              offload=none,optimizer,full trainer.steps=8 profile.enabled=false "${@:2}" ;;
*) echo "usage: $0 30b|235b [balanced|skewed] | offload | full_depth" >&2; exit 2 ;;
esac
pack "$dir"
