#!/usr/bin/env bash
# One 10-minute H200 call re-checking FP8 after issue 40's finding (the FP8 weight copies were stale under fused AdamW,
# moe_lab's default, until 206eaf3) and measuring issue 42's points at the current kernels (FP8 weight gradients where
# rows per expert reach 8,192):
#   1. the quality study's two 1,200-step runs (run.sh quality), bf16 and FP8 experts side by side on the one GPU
#      (15 GiB each; their step times are not read), beside the gpu tests of the FP8 weight gradients;
#   2. the full-depth share (48 layers, 16 experts) fused + selective at seq 4096 x batch 4 and at seq 16384:
#      precision=bf16 against fp8_experts, each point alone on the GPU.
# Records: records/h200_quality/<STAMP>/{0,1}, records/h200_e2e_48l16e_seq4096|16384/<STAMP>, packed into $OUT.
source "$(dirname "$0")/../common.sh"
QUALITY=(+experiment=real_routing model.routing=learned dispatcher=fused model.num_experts=16 data.seq_len=1024
  trainer.steps=1200 trainer.eval_every=100 trainer.eval_batches=16 trainer.expert_load_every=50 profile.enabled=false)
quality=$(record quality)
bash experiments/real_routing/run.sh prepare
for i in 0 1; do
  precision=$([ "$i" = 0 ] && echo fp8_experts || echo bf16)
  timeout -k 20 220 python3 -m moe_lab.train "${QUALITY[@]}" precision="$precision" hydra.run.dir="$quality/$i" \
    > "$quality.$i.log" 2>&1 &
done
timeout -k 10 150 python3 -m pytest tests/test_fp8.py -q -p no:randomly -p no:cacheprovider -m gpu -rs \
  -k "weight_gradients or deep_gemm_fp8_matches_reference" > "$quality.gpu_tests.log" 2>&1
wait
share() {  # share SEQ PRECISIONS
  local dir
  dir=$(record "e2e_48l16e_seq$1")
  timeout -k 20 "$3" python3 -m moe_lab.train -m +experiment=full_depth hydra.sweep.dir="$dir" data.seq_len="$1" \
    data.batch_size=$((16384 / $1)) ac=selective precision="$2" > "$dir.log" 2>&1
  echo "$dir"
}
s4096=$(share 4096 bf16,fp8_experts 150)
s16384=$(share 16384 bf16,fp8_experts 150)
pack "$quality" "$quality".*.log "$s4096" "$s4096.log" "$s16384" "$s16384.log"
