#!/usr/bin/env bash
# real_routing's runs, one part per call (README.md says what they answer):
#   bash experiments/real_routing/run.sh prepare   tokenise the shipped corpus (CPU, about 30 s; offline: no download)
#   bash experiments/real_routing/run.sh one_gpu   learned / balanced / skewed routing x torch / fused on one GPU
#   bash experiments/real_routing/run.sh two_gpu   the same on 2 GPUs (dp_shard 2 x ep 2)
# The GPU parts prepare the data first when it is missing. Overrides after the part narrow the sweep:
#   bash experiments/real_routing/run.sh one_gpu dispatcher=fused model.routing=learned
# On the GPU machines the prepare step needs the `datasets` wheel (benchmarks/fetch_wheels.sh; transformers and
# tokenizers are in their image). Records: records/<machine>_1gpu|2gpu/<UTC start>/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
DATA=experiments/real_routing/data/shakespeare

prepare() {
  [ -f "$DATA/meta.json" ] && return 0
  python3 -m moe_lab.data.prepare --dataset experiments/real_routing/corpus/shakespeare.txt --text-unit paragraph \
    --train-tokenizer 8192 --eval-fraction 0.1 --out "$DATA"
}

case "${1:-}" in
prepare) prepare; exit ;;
one_gpu) prepare && dir=$(record 1gpu) && timeout 540 python3 -m moe_lab.train -m +experiment=real_routing hydra.sweep.dir="$dir" "${@:2}" ;;
two_gpu) prepare && dir=$(record 2gpu) && timeout 540 python3 -m moe_lab.train -m +experiment=real_routing/two_gpu hydra.sweep.dir="$dir" "${@:2}" ;;
*) echo "usage: $0 prepare|one_gpu|two_gpu" >&2; exit 2 ;;
esac
pack "$dir"
