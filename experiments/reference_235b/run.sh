#!/usr/bin/env bash
# The published reference run (preset.yaml) and its plans past it (README.md says what each part answers):
#   MACHINE=h200 bash experiments/reference_235b/run.sh [full|selective]
#       the full Qwen3-235B-A22B on 4 nodes x 8 GPUs, one process per GPU from srun, from a SLURM allocation of
#       those nodes; AC as the argument (default full)
#   bash experiments/reference_235b/run.sh plan
#       python -m moe_lab.plan on 64 and 128 H200: parallel.dp_replicate x parallel.reshard_after_forward, fused
#       dispatcher (no GPU: runs anywhere, a few minutes on CPU)
#   bash experiments/reference_235b/run.sh emulate
#       one H200 as rank 0 of 128 H200 (parallel.emulate): the fastest HSDP layout planned (2 replicas of 64,
#       reshard_after_forward=true, fused + selective AC, dispatcher.save=inputs) and R=1 beside it; two points,
#       about 5-6 minutes
# Records: records/<machine>_32gpu/<UTC start>_ac-<ac>/, plans records/h200_<N>gpu/<UTC start>_plan/, emulated ranks
# records/<machine>_rank0_of_128/<UTC start>_emulate/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
part=${1:-full}
case "$part" in
full | selective)
  dir=$(record 32gpu)_ac-$part
  srun -N 4 --ntasks-per-node 8 --gpus-per-node 8 python3 -m moe_lab.train +experiment=reference_235b ac="$part" \
    hydra.run.dir="$dir"
  pack "$dir" ;;
plan)
  dirs=()
  for gpus in 64 128; do
    dir="experiments/reference_235b/records/h200_${gpus}gpu/${STAMP}_plan"
    python3 -m moe_lab.plan -m +experiment=reference_235b hardware=h200 hardware.gpus_per_node=8 \
      hardware.nodes=$((gpus / 8)) dispatcher=fused parallel.dp_replicate=1,2,4,8 \
      parallel.reshard_after_forward=true,false hydra.sweep.dir="$dir"
    dirs+=("$dir")
  done
  pack "${dirs[@]}" ;;
emulate)
  dir=$(record rank0_of_128)_emulate
  timeout -k 30 520 python3 -m moe_lab.train -m +experiment=reference_235b parallel.emulate=true \
    trainer.nproc_per_node=8 parallel.emulate_nodes=16 dispatcher=fused ac=selective dispatcher.save=inputs \
    parallel.dp_replicate=2,1 \
    trainer.steps=5 trainer.timing_skip=3 profile.enabled=false hydra.sweep.dir="$dir"
  pack "$dir" ;;
*) echo "usage: $0 [full|selective] | plan | emulate" >&2; exit 2 ;;
esac
