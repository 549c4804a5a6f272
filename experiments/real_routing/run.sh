#!/usr/bin/env bash
# real_routing's runs, one part per call (README.md says what they answer):
#   bash experiments/real_routing/run.sh prepare   tokenise the shipped corpus (CPU, about 30 s; offline: no download)
#   bash experiments/real_routing/run.sh one_gpu   learned / balanced / skewed routing x torch / fused on one GPU
#   bash experiments/real_routing/run.sh two_gpu   the same on 2 GPUs (dp_shard 2 x ep 2)
# The GPU parts prepare the data first when it is missing. Overrides after the part narrow the sweep:
#   bash experiments/real_routing/run.sh one_gpu dispatcher=fused model.routing=learned
# On the GPU machines the prepare step needs the `datasets` wheel (scripts/fetch_wheels.sh; transformers and
# tokenizers are in their image). Records: records/<machine>_1gpu|2gpu/<UTC start>/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
DATA=experiments/real_routing/data/shakespeare

prepare() {
  [ -f "$DATA/meta.json" ] && return 0
  python3 -m moe_lab.data.prepare --dataset experiments/real_routing/corpus/shakespeare.txt --text-unit paragraph \
    --train-tokenizer 8192 --eval-fraction 0.1 --out "$DATA"
}

# A part fits one 10-minute device call with the wheel install before it: the sweep gets what is left of BUDGET
# seconds after the prepare step; the timeout's SIGTERM records the point it cuts as `interrupted` at its next step
# boundary and ends the sweep, and a sweep still running 45 s later (stuck before a step boundary) is killed.
BUDGET=${BUDGET:-520}
sweep() {  # sweep LABEL PRESET OVERRIDES...
  dir=$(record "$1")
  prepare || return
  timeout -k 45 $((BUDGET - SECONDS - 45)) python3 -m moe_lab.train -m +experiment="$2" hydra.sweep.dir="$dir" "${@:3}"
}

case "${1:-}" in
prepare) prepare; exit ;;
one_gpu) sweep 1gpu real_routing "${@:2}" ;;
two_gpu) sweep 2gpu real_routing/two_gpu "${@:2}" ;;
*) echo "usage: $0 prepare|one_gpu|two_gpu" >&2; exit 2 ;;
esac
pack "$dir"
