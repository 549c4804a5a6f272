#!/usr/bin/env bash
# One MoE layer forward+backward, torch dispatcher vs fused (benchmarks/moe_layer.py), one part per call:
#   bash experiments/moe_layer/run.sh ep1 [CHUNKS]   one GPU: 30B and 235B shapes, 4k-16k tokens, balanced and skewed routing
#   bash experiments/moe_layer/run.sh ep2 [CHUNKS]   two GPUs (EP=2): 8k and 16k tokens per GPU
#   bash experiments/moe_layer/run.sh overlap        the fused op's pipeline: chunks=1 (exchange, then compute) vs the
#                                                    default, 30B and 235B at 16k tokens, at EP=1 then EP=2 (four records)
# CHUNKS: the fused dispatcher's dispatcher.chunks (default: the dispatcher's own); a record made with it is labelled
# ep1_chunks<N> / ep2_chunks<N>. Records: records/<machine>_<label>/<UTC start>.json (see ../common.sh).
source "$(dirname "$0")/../common.sh"
ep1() {  # ep1 LABEL ARGS...
  local out; out=$(record "$1").json; shift
  timeout 300 python3 benchmarks/moe_layer.py --gemm=auto --iters=10 --out "$out" "$@" >&2 && echo "$out"
}
ep2() {
  local out; out=$(record "$1").json; shift
  timeout 200 torchrun --nproc_per_node 2 benchmarks/moe_layer.py --gemm auto --out "$out" "$@" >&2 && echo "$out"
}
chunks=${2:+--chunks=$2}
label=${2:+_chunks$2}
case "${1:-}" in
ep1) outs=$(ep1 "ep1$label" --models=qwen3_30b,qwen3_235b --tokens=4096,8192,16384 --routing=balanced,skewed --profile $chunks) ;;
ep2) outs=$(ep2 "ep2$label" --tokens 8192,16384 $chunks) ;;
overlap)
  outs=""
  for c in 1 default; do
    args=(--models=qwen3_30b,qwen3_235b --tokens=16384 --routing=balanced,skewed --no-profile)
    [ "$c" = default ] && suffix="" || { args+=(--chunks="$c"); suffix="_chunks$c"; }
    outs+=" $(ep1 "ep1$suffix" "${args[@]}") $(ep2 "ep2$suffix" "${args[@]}")"
  done ;;
*) echo "usage: $0 ep1|ep2 [CHUNKS] | overlap" >&2; exit 2 ;;
esac
echo "records:$outs" | tr ' ' '\n'
pack $outs
