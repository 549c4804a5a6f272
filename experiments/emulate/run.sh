#!/usr/bin/env bash
# One H200 as one rank of a larger layout (parallel.emulate; README.md says what each part answers). Every point runs
# 8 steps timed from step 3 (trainer.steps=8 trainer.timing_skip=3; 235b: 5 steps, timed from step 3, its steps
# planned near 10 s), without the profiler but for the `trace` part, to keep the batch short: the brief was about
# 8 minutes of one H200 for all of it, and it does not fit that. Estimated (about 1 min of build and compile per
# point, then its steps): 30b about 7 min, 235b about 5.5 min, trace + share + overhead about 5 min, so three
# device calls of under 10 minutes each (each sweep is also cut at 520 s; an OOM is a record and the sweep goes on):
#   bash experiments/emulate/run.sh 30b        reference_30b's rank 0 of 8 (FSDP 8 x EP 8): dispatcher x ac, 6 points
#   bash experiments/emulate/run.sh 235b       reference_235b's rank 0 of 32, 64 and 128 GPUs at EP 8, fused + full AC
#   bash experiments/emulate/run.sh trace share overhead
#     trace     the 30b rank, fused + full AC, two steps traced (the breakdown's collectives at zero)
#     ep_trace  the 30b rank, fused + selective at EP 1 (experts sharded by FSDP: 128 experts of 1,024 rows a rank)
#               and EP 8 (16 experts of 8,192 rows), two steps traced: where tune's EP 1 winner lost its plan
#     share     the 48-layer, 16-expert single-GPU share of the 30B at EP 8 (no FSDP, no exchange), fused +
#               selective | full, beside the 30b part's rank
#     overhead  world 1: a plain one-GPU run and an emulated one (4-layer 30B proxy, fused + selective)
#   bash experiments/emulate/run.sh plan       python -m moe_lab.plan of the same points and the published 235B table
#                                              on the B300 profile (no GPU: runs anywhere, a few minutes on CPU)
#   bash experiments/emulate/run.sh leak_probe the 30b rank at 4 layers, torch dispatcher + full AC, compiled, twice
#     (plain checkpoint as before issue 43's fix, then ac=full as it is): peak memory and the allocations live at the
#     peak (leak_probe.py), beside the plan of the same point; about 1.5 min each, under 3 min in all
#     (model.num_layers=48 after it: the whole rank, about 2 min each; each run is cut at 280 s)
# Parts run in the order given; overrides after them (key=value) narrow every sweep.
# Records: records/<machine>_<label>/<UTC start>_<part>/ (../common.sh), plans records/<hardware>_<label>/.
source "$(dirname "$0")/../common.sh"
SHORT=(trainer.steps=8 trainer.timing_skip=3 profile.enabled=false)
EMULATE_30B=(+experiment=reference_30b parallel.emulate=true)
EMULATE_235B=(+experiment=reference_235b parallel.emulate=true trainer.nproc_per_node=8)
dirs=()
sweep() {  # sweep LABEL OVERRIDES...
  local dir
  dir=$(record "$1")_$part
  timeout -k 30 520 python3 -m moe_lab.train -m hydra.sweep.dir="$dir" "${@:2}"
  dirs+=("$dir")
}
plan() {  # plan LABEL OVERRIDES...
  local dir="experiments/emulate/records/$1/${STAMP}_plan"
  python3 -m moe_lab.plan -m hydra.sweep.dir="$dir" "${@:2}"
  dirs+=("$dir")
}
run_part() {
  part=$1
  shift
  case "$part" in
  30b) sweep rank0_of_8 "${EMULATE_30B[@]}" dispatcher=torch,fused ac=none,selective,full "${SHORT[@]}" "$@" ;;
  trace) sweep rank0_of_8 "${EMULATE_30B[@]}" dispatcher=fused ac=full trainer.steps=8 trainer.timing_skip=3 \
           profile.enabled=true profile.wait=5 profile.warmup=1 profile.active=2 "$@" ;;
  ep_trace) sweep rank0_of_8 "${EMULATE_30B[@]}" dispatcher=fused ac=selective parallel.ep=1,8 trainer.steps=8 \
              trainer.timing_skip=3 profile.enabled=true profile.wait=5 profile.warmup=1 profile.active=2 "$@" ;;
  235b) sweep rank0_235b "${EMULATE_235B[@]}" parallel.emulate_nodes=4,8,16 dispatcher=fused ac=full \
          trainer.steps=5 trainer.timing_skip=3 profile.enabled=false "$@" ;;
  share) sweep 1gpu_share +experiment=reference_30b trainer.nproc_per_node=1 parallel.ep=1 model.num_experts=16 \
           dispatcher=fused ac=selective,full "${SHORT[@]}" "$@" ;;
  overhead) sweep 1gpu_overhead +experiment=benchmark model=qwen3_30b model.num_layers=4 dispatcher=fused \
              ac=selective parallel.emulate=false,true "${SHORT[@]}" "$@" ;;
  leak_probe)
    local dir variant
    dir=$(record leak_probe)_$part
    for variant in plain option; do
      timeout -k 30 280 python3 experiments/emulate/leak_probe.py --ac "$variant" "$dir/$variant" "${EMULATE_30B[@]}" \
        dispatcher=torch ac=full model.num_layers=4 trainer.steps=4 trainer.timing_skip=2 profile.enabled=false "$@"
    done
    dirs+=("$dir")
    plan h200_8gpu_4_layers +experiment=reference_30b hardware=h200 hardware.gpus_per_node=8 dispatcher=torch ac=full \
      model.num_layers=4 trainer.steps=4 trainer.timing_skip=2 profile.enabled=false "$@" ;;
  plan)
    plan h200_8gpu +experiment=reference_30b hardware=h200 hardware.gpus_per_node=8 dispatcher=torch,fused \
      ac=none,selective,full "${SHORT[@]}" "$@"
    plan h200_235b +experiment=reference_235b hardware=h200 hardware.gpus_per_node=8 \
      hardware.nodes=4,8,16 dispatcher=fused ac=full "${SHORT[@]}" "$@"
    plan h200_1gpu_share +experiment=reference_30b trainer.nproc_per_node=1 parallel.ep=1 model.num_experts=16 \
      hardware=h200 hardware.gpus_per_node=1 dispatcher=fused ac=selective,full "${SHORT[@]}" "$@"
    plan b300_32gpu +experiment=reference_235b hardware=b300 hardware.nodes=4 hardware.gpus_per_node=8 \
      dispatcher=torch,fused ac=full,selective "$@" ;;
  *) echo "usage: $0 PART... [key=value...]; parts: 30b 235b trace share overhead plan leak_probe" >&2; exit 2 ;;
  esac
}
run_parts "$@"
