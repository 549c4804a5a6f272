#!/usr/bin/env bash
# Offload modes on one GPU (experiments/offload_depth/offload_gpu.py), one part per call:
#   bash experiments/offload_depth/run.sh compare   none / optimizer / full side by side on the 4-layer proxy
#   bash experiments/offload_depth/run.sh search    the deepest proxy each mode fits, resumed from the latest record
#                                                   (a mode already resolved there is not searched again)
#   bash experiments/offload_depth/run.sh fresh     compare, then the search from nothing (after a change to the
#                                                   offload code: the earlier depths are not trusted); `search` resumes it
# Records: records/<machine>_1gpu/<UTC start>.json, each holding the searches it resumed (see ../common.sh).
source "$(dirname "$0")/../common.sh"
latest=$(ls "experiments/$STUDY/records/${MACHINE}_1gpu/"*.json 2>/dev/null | tail -1)
out=$(record 1gpu).json
case "${1:-}" in
compare) timeout 300 python3 experiments/offload_depth/offload_gpu.py --phase compare --out "$out" ;;
search) [ -n "$latest" ] && cp "$latest" "$out"
        timeout 330 python3 experiments/offload_depth/offload_gpu.py --phase search --modes optimizer,full --budget-s 300 \
          --point-timeout-s 150 --out "$out" ;;
fresh) timeout 560 python3 experiments/offload_depth/offload_gpu.py --phase both --budget-s 420 --point-timeout-s 150 --out "$out" ;;
*) echo "usage: $0 compare|search|fresh" >&2; exit 2 ;;
esac
pack "$out"
