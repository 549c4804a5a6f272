#!/usr/bin/env bash
# python -m moe_lab.tune on three layouts, each a tune of the default space (conf/tune/default.yaml) with its best 3
# measured on one H200 (README.md says what each answers), and the published 235B table's layout planned on B300:
#   bash experiments/tune/run.sh 30b      Qwen3-30B-A3B on 8 H200 (FSDP 8), seq 16384: rank 0 emulated
#   bash experiments/tune/run.sh 235b     Qwen3-235B-A22B on 32 H200 (4 x 8), seq 16384: rank 0 emulated
#   bash experiments/tune/run.sh share    the full-depth single-GPU share of the 30B at EP 8 (48 layers, 16
#                                         experts), seq 4096 x batch 4: real, one GPU
#   bash experiments/tune/run.sh b300     Qwen3-235B-A22B on 32 B300 (4 x 8), seq 16384, plan only (no GPU needed)
#   bash experiments/tune/run.sh share_trace  the share's winner (fused + selective, precision=fp8) and bf16 beside
#                                         it, two steps traced: where the share's plan and measurement part
# Each of the first three is meant to finish within 10 minutes of one H200, planning included: few steps a
# candidate (8 timed from 3; 235B's steps are planned near 10 s: 5 from 3), no profiler, and a 570 s cut
# (TUNE_TIMEOUT; 0: none, for planning on a small CPU machine, where the default space takes tens of minutes).
# Without a GPU they stop after planning (what is committed from the CPU machine: records/cpu_*). Overrides after the parts
# (key=value) narrow every tune. Records: records/<machine>_<label>/<UTC start>/ (../common.sh): each a tune's
# directory (tune.json, plans.csv, report.md, tune.png, measured/: the candidates' records).
source "$(dirname "$0")/../common.sh"
SHORT=(trainer.steps=8 trainer.timing_skip=3 profile.enabled=false)
dirs=()
tune() {  # tune LABEL OVERRIDES...
  local dir
  dir=$(record "$1")
  timeout -k 30 "${TUNE_TIMEOUT:-570}" python3 -m moe_lab.tune tune.dir="$dir" tune.workers=8 "${@:2}"
  dirs+=("$dir")
}
run_part() {
  part=$1
  shift
  case "$part" in
  30b) tune 30b_8gpu +experiment=reference_30b "${SHORT[@]}" "$@" ;;
  235b) tune 235b_32gpu +experiment=reference_235b trainer.nproc_per_node=8 hardware.nodes=4 \
          trainer.steps=5 trainer.timing_skip=3 profile.enabled=false "$@" ;;
  share) tune 1gpu_share +experiment=reference_30b trainer.nproc_per_node=1 model.num_experts=16 \
           data.seq_len=4096 data.batch_size=4 "${SHORT[@]}" "$@" ;;
  share_trace) dir=$(record 1gpu_share)_trace
    timeout -k 30 400 python3 -m moe_lab.train -m hydra.sweep.dir="$dir" +experiment=reference_30b \
      trainer.nproc_per_node=1 model.num_experts=16 data.seq_len=4096 data.batch_size=4 dispatcher=fused \
      ac=selective precision=fp8,bf16 parallel.ep=1 trainer.steps=8 trainer.timing_skip=3 profile.enabled=true \
      profile.wait=5 profile.warmup=1 profile.active=2 "$@"
    dirs+=("$dir") ;;
  b300) MACHINE=plan tune b300_32gpu +experiment=reference_235b hardware=b300 hardware.nodes=4 \
          hardware.gpus_per_node=8 tune.measure=0 "$@" ;;
  *) echo "usage: $0 PART... [key=value...]; parts: 30b 235b share b300 share_trace" >&2; exit 2 ;;
  esac
}
run_parts "$@"
