#!/usr/bin/env bash
# The runs behind docs/performance.md, on one two-GPU H200 machine, in phases that each fit a 10-minute device call:
#   bash benchmarks/performance_suite.sh PHASE OUT_DIR
# Every phase writes its sweep directories (result.json + metrics.jsonl per point, traces left out) as
# OUT_DIR/<name>.tgz and its logs as OUT_DIR/<phase>.log; unpack them under results/ and regenerate the doc's tables
# with `python benchmarks/performance_tables.py`.
#   two_gpu    grid_30b's dispatcher x ac at offload=none on 2 GPUs (dp_shard 2 x ep 2); torchtitan 0.2.2 beside it
#              (FSDP2 + EP2); the MoE-layer benchmark at EP=2
#   one_gpu    grid_30b on GPU 0 (dispatcher x ac x offload) while GPU 1 runs torchtitan's one-GPU points, then the
#              one-GPU tests of the fused dispatcher, the trace breakdown, the offload modes and forced routing
#   depth      the two-GPU tests (fused dispatcher at EP=2, distinct experts per EP rank), then the offload depth search (deepest proxy per mode; a mode
#              already resolved in results/offload_gpu_h200.json is not searched again)
#   seq8192    grid_30b's offload=none points at seq 8192 on 2 GPUs, torchtitan beside them
#   routing_skew  the routing-skew study's two ends (Zipf 0.5 and 2.0) with each dispatcher at seq 16384 on 2 GPUs
set -uo pipefail
phase=$1
out=$(realpath -m "$2")
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
work=/tmp/moe_lab_suite
mkdir -p "$work"

pack() {  # pack NAME DIR: a sweep's records without its traces
  tar -czf "$out/$1.tgz" --exclude='trace_rank*' -C "$(dirname "$2")" "$(basename "$2")"
}

case "$phase" in
two_gpu)
  timeout 300 python3 -m moe_lab.train -m +experiment=grid_30b offload=none trainer.nproc_per_node=2 parallel.ep=2 \
    hydra.sweep.dir="$work/grid_30b_2gpu"
  pack grid_30b_2gpu "$work/grid_30b_2gpu"
  timeout 170 python3 benchmarks/torchtitan_baseline.py --seq-lens 16384 --points 2:full,2:selective --timeout 80 \
    --out "$out/torchtitan_h200_2gpu.json"
  timeout 150 torchrun --nproc_per_node 2 benchmarks/moe_layer.py --gemm auto --tokens 8192,16384 \
    --out "$out/moe_layer_h200_ep2.json"
  ;;
one_gpu)
  (
    export CUDA_VISIBLE_DEVICES=1
    timeout 250 python3 benchmarks/torchtitan_baseline.py --seq-lens 16384 --points 1:full,1:selective --timeout 120 \
      --out "$out/torchtitan_h200_1gpu.json"
    timeout 270 python3 -m pytest -m gpu tests/test_fused_gpu.py tests/test_trace.py tests/test_offload.py tests/test_moe_layer.py -q -rs \
      -p no:cacheprovider -k "not expert_parallel_2"
  ) > "$out/lane_gpu1.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout 520 python3 -m moe_lab.train -m +experiment=grid_30b hydra.sweep.dir="$work/grid_30b_1gpu"
  wait
  pack grid_30b_1gpu "$work/grid_30b_1gpu"
  ;;
depth)
  timeout 120 python3 -m pytest -m gpu tests/test_fused_gpu.py tests/test_distributed_training.py -q -rs \
    -p no:cacheprovider -k "expert_parallel_2 or different_experts"
  cp results/offload_gpu_h200.json "$out/offload_gpu_h200.json"
  timeout 330 python3 benchmarks/offload_gpu.py --phase search --modes optimizer,full --budget-s 300 \
    --point-timeout-s 150 --out "$out/offload_gpu_h200.json"
  ;;
seq8192)
  timeout 260 python3 -m moe_lab.train -m +experiment=grid_30b offload=none data.seq_len=8192 \
    trainer.nproc_per_node=2 parallel.ep=2 hydra.sweep.dir="$work/grid_30b_2gpu_seq8192"
  pack grid_30b_2gpu_seq8192 "$work/grid_30b_2gpu_seq8192"
  timeout 150 python3 benchmarks/torchtitan_baseline.py --seq-lens 8192 --points 2:full,2:selective --timeout 70 \
    --out "$out/torchtitan_h200_2gpu_seq8192.json"
  ;;
routing_skew)
  timeout 280 python3 -m moe_lab.train -m +experiment=routing_skew model.routing_skew=0.5,2.0 dispatcher=torch,fused \
    ac=selective hydra.sweep.dir="$work/routing_skew_2gpu"
  pack routing_skew_2gpu "$work/routing_skew_2gpu"
  ;;
*)
  echo "unknown phase $phase (two_gpu, one_gpu, depth, seq8192, routing_skew)" >&2
  exit 2
  ;;
esac
