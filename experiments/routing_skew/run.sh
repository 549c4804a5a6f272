#!/usr/bin/env bash
# The routing-skew study's two ends (Zipf 0.5 and 2.0), each dispatcher, selective AC, on 2 GPUs; fits a 10-minute
# device call (the preset alone sweeps five exponents with full AC and the torch dispatcher):
#   bash experiments/routing_skew/run.sh
# Records: records/<machine>_2gpu/<UTC start>/, one directory per point (see ../common.sh).
source "$(dirname "$0")/../common.sh"
dir=$(record 2gpu)
timeout 280 python3 -m moe_lab.train -m +experiment=routing_skew model.routing_skew=0.5,2.0 dispatcher=torch,fused \
  ac=selective hydra.sweep.dir="$dir"
pack "$dir"
