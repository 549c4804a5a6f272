#!/usr/bin/env bash
# grid_235b's runs, one part per 10-minute device call (README.md says what they answer):
#   bash experiments/grid_235b/run.sh two_gpu   dispatcher x ac on 2 GPUs (dp_shard 2 x ep 2)   nvidia-h200-x2
#   bash experiments/grid_235b/run.sh one_gpu   the same on one GPU (what fits)                 nvidia-h200
# torchtitan on the same proxy: experiments/torchtitan_baseline/run.sh two_gpu_235b|one_gpu_235b.
# Each point is its own job under its own timeout, so a hung point costs at most POINT_S seconds and the rest still
# run; its SIGTERM stops the point at the next step boundary, recorded `interrupted` (2 GPUs: the launcher records it
# even for ranks that never reach one); a single process still running KILL_S seconds later is killed, leaving no
# result.json (the part's output says so). The whole part stops starting points past BUDGET seconds.
# Overrides after the part go to every point. Records: records/<machine>_2gpu|1gpu/<UTC start>/<n>/ (../common.sh).
source "$(dirname "$0")/../common.sh"
BUDGET=${BUDGET:-520} POINT_S=${POINT_S:-100} KILL_S=45

grid() {  # grid LABEL PRESET OVERRIDES...: the points, the likely fastest first
  dir=$(record "$1")
  local n=0 ac dispatcher left
  for ac in none selective full; do
    for dispatcher in fused torch; do
      left=$((BUDGET - SECONDS - KILL_S))
      if ((left < 60)); then echo "grid_235b: out of time, not run: dispatcher=$dispatcher ac=$ac" >&2; continue; fi
      timeout -k "$KILL_S" $((left < POINT_S ? left : POINT_S)) python3 -m moe_lab.train +experiment="$2" \
        dispatcher="$dispatcher" ac="$ac" hydra.run.dir="$dir/$n" "${@:3}"
      [ -f "$dir/$n/result.json" ] || echo "grid_235b: $dir/$n (dispatcher=$dispatcher ac=$ac) left no record" >&2
      n=$((n + 1))
    done
  done
}

case "${1:-}" in
two_gpu) grid 2gpu grid_235b "${@:2}" ;;
one_gpu) grid 1gpu grid_235b/one_gpu "${@:2}" ;;
*) echo "usage: $0 two_gpu|one_gpu" >&2; exit 2 ;;
esac
pack "$dir"
