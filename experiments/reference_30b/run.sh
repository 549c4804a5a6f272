#!/usr/bin/env bash
# The one-node reference run (preset.yaml) and its plans past one node (README.md says what each part answers):
#   bash experiments/reference_30b/run.sh [8gpu]   the full Qwen3-30B-A3B on 8 GPUs, full and selective AC
#   bash experiments/reference_30b/run.sh plan     python -m moe_lab.plan on 16 and 64 H200: parallel.dp_replicate x
#                                                  parallel.reshard_after_forward, fused dispatcher, and the 64
#                                                  at seq 4096 (no GPU: runs anywhere, a few minutes on CPU)
#   bash experiments/reference_30b/run.sh emulate  one H200 as rank 0 of 64 H200 (parallel.emulate): the fastest
#                                                  HSDP layout planned at seq 16384 (8 replicas of one node,
#                                                  reshard_after_forward=false, fused + selective AC) and R=1 beside
#                                                  it; two points, about 3-4 minutes
# Records: records/<machine>_8gpu/<UTC start>/, plans records/h200_<N>gpu/<UTC start>_plan/, emulated ranks
# records/<machine>_rank0_of_64/<UTC start>_emulate/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
part=${1:-8gpu}
case "$part" in
8gpu)
  dir=$(record 8gpu)
  python3 -m moe_lab.train -m +experiment=reference_30b ac=full,selective hydra.sweep.dir="$dir"
  pack "$dir" ;;
plan)
  dirs=()
  for gpus in 16 64; do
    replicas=$([ "$gpus" = 16 ] && echo 1,2 || echo 1,2,4,8)
    dir="experiments/reference_30b/records/h200_${gpus}gpu/${STAMP}_plan"
    python3 -m moe_lab.plan -m +experiment=reference_30b hardware=h200 hardware.gpus_per_node=8 \
      hardware.nodes=$((gpus / 8)) dispatcher=fused parallel.dp_replicate="$replicas" \
      parallel.reshard_after_forward=true,false hydra.sweep.dir="$dir"
    dirs+=("$dir")
  done
  # where HSDP pays: the same 64 GPUs at seq 4096 (a quarter of the compute a step, the same FSDP2 bytes)
  dir="experiments/reference_30b/records/h200_64gpu/${STAMP}_plan_seq4096"
  python3 -m moe_lab.plan -m +experiment=reference_30b hardware=h200 hardware.gpus_per_node=8 hardware.nodes=8 \
    dispatcher=fused data.seq_len=4096 parallel.dp_replicate=1,2,4,8 parallel.reshard_after_forward=true,false \
    hydra.sweep.dir="$dir"
  dirs+=("$dir")
  pack "${dirs[@]}" ;;
emulate)
  dir=$(record rank0_of_64)_emulate
  timeout -k 30 520 python3 -m moe_lab.train -m +experiment=reference_30b parallel.emulate=true \
    parallel.emulate_nodes=8 dispatcher=fused ac=selective parallel.reshard_after_forward=false \
    parallel.dp_replicate=8,1 \
    trainer.steps=8 trainer.timing_skip=3 profile.enabled=false hydra.sweep.dir="$dir"
  pack "$dir" ;;
*) echo "usage: $0 [8gpu] | plan | emulate" >&2; exit 2 ;;
esac
