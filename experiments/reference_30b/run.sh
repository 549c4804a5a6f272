#!/usr/bin/env bash
# The one-node reference run (preset.yaml): the full Qwen3-30B-A3B on 8 GPUs, full and selective AC:
#   bash experiments/reference_30b/run.sh
# Records: records/<machine>_8gpu/<UTC start>/, one directory per point (see ../common.sh).
source "$(dirname "$0")/../common.sh"
dir=$(record 8gpu)
python3 -m moe_lab.train -m +experiment=reference_30b ac=full,selective hydra.sweep.dir="$dir"
pack "$dir"
