#!/usr/bin/env bash
# FP8 experts (dispatcher.expert_precision=fp8) against bf16, one H200; one part per call (README.md says what each
# answers):
#   bash experiments/fp8/run.sh probe    DeepGEMM's FP8 API on this GPU: signatures, scale layouts, correctness, speed
#   bash experiments/fp8/run.sh layer    one MoE layer fwd+bwd, fused bf16 vs fused FP8: 30B and 235B shapes,
#                                        4k-16k tokens, balanced and skewed (records hold fp8_over_bf16)
#   bash experiments/fp8/run.sh wgrad    wgrad_probe.py: the weight-gradient GEMMs in FP8 (a Triton blockwise k-grouped kernel,
#                                        torch._scaled_grouped_mm rowwise) against bf16 torch._grouped_mm, both shapes
#   bash experiments/fp8/run.sh layer_accum   the same at 16k balanced tokens, 4 micro-batches per optimizer step
#                                        (the FP8 weight copies made once per 4 steps, as with gradient accumulation)
#   bash experiments/fp8/run.sh e2e      training steps, the 4-layer 30B proxy at seq 16384: bf16 vs fp8, each AC mode
#                                        (overrides after it win: `e2e dispatcher=torch ac=selective`, the torch dispatcher)
#   bash experiments/fp8/run.sh e2e_full_depth   the same for the 48-layer / 16-expert share (selective, full)
#   bash experiments/fp8/run.sh quality  1,200 steps on real text (real_routing's corpus), 4-layer 16-expert 30B-wide
#                                        model, learned routing + aux loss, seq 1024 (5.5 epochs of the corpus: longer
#                                        samples overfit before the end): fp8 vs bf16 loss curves (about 2 x 1.5 min)
# Issue 42 ("FP8 that pays"):
#   bash experiments/fp8/run.sh kernel_probe   kernel_probe.py: every expert GEMM (fprop, dgrad, wgrad) at the full-depth
#                                        share (16 experts x 8,192 rows) and at 128 x 1,024, 30B and 235B widths: bf16
#                                        (torch, DeepGEMM) vs blockwise FP8 for each sgl-deep-gemm wheel in .whl/
#                                        (0.1.5.post1, kernel_probe/0.2.1, 0.2.5); the attention projections in bf16 vs
#                                        torchao float8 (tensorwise, rowwise, blockwise prototype) vs DeepGEMM's dense
#                                        FP8 GEMM (about 8.5 minutes)
#   bash experiments/fp8/run.sh kernel_probe_dense   its dense section alone (compiled torchao, DeepGEMM's dense GEMM
#                                        in 0.1.5.post1, the k-grouped quantizer), the whole budget for it
#   bash experiments/fp8/run.sh share_seq4096   the full-depth share (48 layers, 16 experts) at seq 4096 x batch 4:
#                                        precision=fp8,bf16,fp8_experts x ac=selective,full (resume: STAMP=<stamp>)
#   bash experiments/fp8/run.sh share_seq16384  the same at seq 16384 x batch 1
#   bash experiments/fp8/run.sh torchtitan_seq4096   torchtitan 0.2.2 at that shape (--experts 16, batch 4), each AC
#   bash experiments/fp8/run.sh layer16k  one MoE layer at 16k balanced tokens, both widths, the copies made every
#                                        step: fused bf16 vs fused FP8 with the kernel breakdown
#   bash experiments/fp8/run.sh layer16k_share  the same with the full-depth share's 16 experts (8,192 rows an expert:
#                                        FP8 weight gradients, DeepGEMM's k-grouped kernel, where 128 experts keep bf16's)
# Each part stops within BUDGET seconds (default 540: one 10-minute device call with the install before it); a sweep
# it cuts resumes when re-run with STAMP=<that record's stamp>.
# Records: records/<machine>_<part>/<UTC start>.json|/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
case "${1:-}" in
probe) out=$(record probe).log && python3 experiments/fp8/probe.py 2>&1 | tee "$out" ;;
layer) out=$(record layer).json && timeout 420 python3 experiments/moe_layer/moe_layer.py --models=qwen3_30b,qwen3_235b \
         --tokens=4096,8192,16384 --routing=balanced,skewed --expert-precision=fp8 --dispatchers=fused,fused_fp8 \
         --iters=10 --profile --out "$out" ;;
wgrad) out=$(record wgrad).json && python3 experiments/fp8/wgrad_probe.py --out "$out" 2>&1 | tee "${out%.json}.log" ;;
layer_accum) out=$(record layer_accum).json && timeout 300 python3 experiments/moe_layer/moe_layer.py \
         --models=qwen3_30b,qwen3_235b --tokens=16384 --routing=balanced --expert-precision=fp8 \
         --dispatchers=fused,fused_fp8 --micro-batches=4 --iters=5 --profile --out "$out" ;;
e2e) dir=$(record e2e) && timeout -k 30 "${BUDGET:-540}" python3 -m moe_lab.train -m +experiment=grid_30b hydra.sweep.dir="$dir" \
       offload=none dispatcher=fused dispatcher.expert_precision=fp8,bf16 ac=selective,full,none "${@:2}" ;;
e2e_full_depth) dir=$(record e2e_48l16e) && timeout -k 30 "${BUDGET:-540}" python3 -m moe_lab.train -m +experiment=grid_30b \
       hydra.sweep.dir="$dir" model.num_layers=48 model.num_experts=16 offload=none dispatcher=fused \
       dispatcher.expert_precision=fp8,bf16 ac=selective,full "${@:2}" ;;
quality) dir=$(record quality) && bash experiments/real_routing/run.sh prepare && timeout -k 30 "${BUDGET:-540}" python3 -m moe_lab.train -m \
       +experiment=real_routing hydra.sweep.dir="$dir" model.routing=learned dispatcher=fused model.num_experts=16 \
       data.seq_len=1024 trainer.steps=1200 trainer.eval_every=100 trainer.eval_batches=16 trainer.expert_load_every=50 \
       profile.enabled=false dispatcher.expert_precision=fp8,bf16 "${@:2}" ;;
kernel_probe) out=$(record kernel_probe).json && timeout -k 10 510 python3 experiments/fp8/kernel_probe.py --out "$out" \
       --deep-gemm .whl/sgl_deep_gemm-0.1.5.post1-*.whl --deep-gemm .whl/kernel_probe/sgl_deep_gemm-0.2.1-*.whl \
       --deep-gemm .whl/kernel_probe/sgl_deep_gemm-0.2.5-*.whl --tvm-ffi .whl/apache_tvm_ffi-*.whl --budget 480 \
       2>&1 | tee "${out%.json}.log" ;;
kernel_probe_dense) out=$(record kernel_probe).json && timeout -k 10 510 python3 experiments/fp8/kernel_probe.py \
       --out "$out" --sections dense --deep-gemm .whl/sgl_deep_gemm-0.1.5.post1-*.whl --tvm-ffi .whl/apache_tvm_ffi-*.whl \
       --budget 480 2>&1 | tee "${out%.json}.log" ;;
share_seq4096|share_seq16384) seq=${1#share_seq}; dir=$(record "e2e_48l16e_seq$seq") && timeout -k 30 "${BUDGET:-540}" \
       python3 -m moe_lab.train -m +experiment=full_depth hydra.sweep.dir="$dir" data.seq_len="$seq" \
       data.batch_size=$((16384 / seq)) ac=selective,full precision=fp8,bf16,fp8_experts "${@:2}" ;;
torchtitan_seq4096) out=$(record torchtitan_48l16e_seq4096).json && timeout 560 python3 \
       experiments/torchtitan_baseline/torchtitan_baseline.py --seq-lens 4096 --batch-size 4 --layers 48 --experts 16 \
       --steps 8 --timing-from 4 --points 1:none,1:full,1:op-selective,1:layer-selective --timeout 130 --out "$out" ;;
layer16k) out=$(record layer16k).json && timeout 420 python3 experiments/moe_layer/moe_layer.py \
       --models=qwen3_30b,qwen3_235b --tokens=16384 --routing=balanced --expert-precision=fp8 \
       --dispatchers=fused,fused_fp8 --iters=10 --profile --out "$out" ;;
layer16k_share) out=$(record layer16k_16e).json && timeout 420 python3 experiments/moe_layer/moe_layer.py \
       --models=qwen3_30b,qwen3_235b --tokens=16384 --routing=balanced --expert-precision=fp8 --experts=16 \
       --dispatchers=fused,fused_fp8 --iters=10 --profile --out "$out" ;;
*) echo "usage: $0 probe|wgrad|layer|layer_accum|e2e|e2e_full_depth|quality|kernel_probe|kernel_probe_dense|share_seq4096|share_seq16384|torchtitan_seq4096|layer16k|layer16k_share" >&2; exit 2 ;;
esac
pack "${out:-$dir}"
