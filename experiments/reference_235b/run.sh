#!/usr/bin/env bash
# The published reference run (preset.yaml): the full Qwen3-235B-A22B on 4 nodes x 8 GPUs, one process per GPU from
# srun, from a SLURM allocation of those nodes; AC as the first argument (default full):
#   MACHINE=h200 bash experiments/reference_235b/run.sh [full|selective]
# Records: records/<machine>_32gpu/<UTC start>_ac-<ac>/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
ac=${1:-full}
dir=$(record 32gpu)_ac-$ac
srun -N 4 --ntasks-per-node 8 --gpus-per-node 8 python3 -m moe_lab.train +experiment=reference_235b ac="$ac" \
  hydra.run.dir="$dir"
pack "$dir"
