#!/usr/bin/env bash
# The walking skeleton's three runs: the tiny model on a GPU, the 30B 2-layer proxy at seq 4096 on one GPU and on
# two (EP 2), torch dispatcher, no AC, no compile:
#   bash experiments/walking_skeleton/run.sh
# Records: records/<machine>_1gpu|2gpu/<UTC start>_<run>/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
proxy="model=qwen3_30b model.num_layers=2 data.seq_len=4096 data.batch_size=1 trainer.steps=12 trainer.warmup_steps=2
       trainer.timing_skip=4 model.routing=balanced"
one=$(record 1gpu) two=$(record 2gpu)
python3 -m moe_lab.train trainer.steps=20 hydra.run.dir="${one}_tiny"
CUDA_VISIBLE_DEVICES=0 python3 -m moe_lab.train $proxy hydra.run.dir="${one}_q30b_l2_s4096"
python3 -m moe_lab.train $proxy trainer.nproc_per_node=2 parallel.ep=2 hydra.run.dir="${two}_q30b_l2_s4096"
pack "${one}_tiny" "${one}_q30b_l2_s4096" "${two}_q30b_l2_s4096"
