#!/usr/bin/env bash
# The host optimizer step of offload=full against the host's memory bandwidth (experiments/host_optimizer/host_optimizer.py), at
# 1, half, all but one (offload=full's default) and all of this process's CPUs:
#   bash experiments/host_optimizer/run.sh
# Records: records/<machine>_host/<UTC start>.json (see ../common.sh).
source "$(dirname "$0")/../common.sh"
out=$(record host).json
python3 experiments/host_optimizer/host_optimizer.py --repeats 3 --out "$out"
pack "$out"
