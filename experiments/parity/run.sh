#!/usr/bin/env bash
# parity's GPU runs, one part per call (README.md says what they answer; the CPU part is tests/test_parity.py):
#   bash experiments/parity/run.sh one_gpu          reference x2 (noise band), each axis once, a resumed run, then
#                                                   python -m moe_lab.compare (band: twice the repeat's spread, plus
#                                                   1e-4 of the loss; README.md says why): compare.txt, noise.json,
#                                                   parity.png
#   bash experiments/parity/run.sh deterministic    trainer.deterministic=true twice: bitwise equal? and its s/step
#   bash experiments/parity/run.sh checkpoint_cost  the preset's 1.9B proxy's checkpoint, sync and async_save
#                                                   (checkpoint_cost.py)
#   bash experiments/parity/run.sh gpu_test         tests/test_determinism.py's GPU tests (deterministic, kill + resume)
# Each part fits one 10-minute device call with the wheel install before it (one_gpu: about 6 minutes). The token data
# is experiments/real_routing's (its run.sh prepare, run first when missing; needs the `datasets` wheel).
# Records: records/<machine>_1gpu/<UTC start>[_deterministic|_checkpoint_cost|_gpu_test]/ (see ../common.sh).
source "$(dirname "$0")/../common.sh"
BUDGET=${BUDGET:-540}
prepare() { bash experiments/real_routing/run.sh prepare; }
AXES=torch,selective,full,offload_optimizer,offload_full,grad_accum  # the variants here, one yaml each
# The one_gpu and deterministic parts narrow the preset's 1.9B proxy to fit their time: width 1024, 64 experts of
# 512, the corpus's 8,192-token vocabulary (about 0.2B parameters), still 2 layers, top-8, learned routing.
SHAPE=(model.hidden_size=1024 model.num_heads=8 model.num_experts=64 model.moe_intermediate_size=512 model.vocab_size=8192)

one_gpu() {
  dir=$(record 1gpu)
  prepare || return
  # Point 0 is the reference (with a step-150 checkpoint), point 1 its repeat, then one point per axis.
  timeout -k 45 $((BUDGET - SECONDS - 75)) python3 -m moe_lab.train -m \
    +experiment=parity,parity,$(echo $AXES | sed 's/\([a-z_]*\)/parity\/\1/g') hydra.sweep.dir="$dir" "${SHAPE[@]}" "$@"
  # resumed: the reference killed after its step-150 checkpoint and started again in its directory (the rows it
  # logged after the checkpoint are dropped on resume)
  mkdir -p "$dir/resumed/checkpoints"
  cp -r "$dir/0/checkpoints/step_00000150" "$dir/resumed/checkpoints/" && cp "$dir/0/metrics.jsonl" "$dir/resumed/" &&
    timeout -k 15 $((BUDGET - SECONDS - 15)) python3 -m moe_lab.train +experiment=parity hydra.run.dir="$dir/resumed" \
      "${SHAPE[@]}" "$@"
  rm -rf "$dir"/*/checkpoints  # 2.6 GB each: not records
  python3 -m moe_lab.compare "$dir/0" $(seq -f "$dir/%g" 2 $(( $(echo $AXES | tr , ' ' | wc -w) + 1 ))) "$dir/resumed" \
    --noise "$dir/1" --noise-factor 2 --rtol 1e-4 --write-noise "$dir/noise.json" --plot "$dir/parity.png" \
    > "$dir/compare.txt" 2>&1
  echo "compare exit status $?" >> "$dir/compare.txt"
  cat "$dir/compare.txt"
}

deterministic() {
  dir=$(record 1gpu)_deterministic
  prepare || return
  timeout -k 45 $((BUDGET - SECONDS - 30)) python3 -m moe_lab.train -m \
    +experiment=parity trainer.deterministic=true,true,false trainer.checkpoint.every=0 hydra.sweep.dir="$dir" \
    "${SHAPE[@]}" "$@"
  { python3 -m moe_lab.compare "$dir/0" "$dir/1" --assert-equal; echo "compare exit status $?"
    python3 - "$dir" <<'PY'
import sys
from moe_lab.results import load
df = load(sys.argv[1])
print(df[["run_dir", "trainer.deterministic", "s_per_step", "tokens_per_s_per_gpu", "peak_gpu_mem_gib"]].to_string())
PY
  } > "$dir/compare.txt" 2>&1
  cat "$dir/compare.txt"
}

checkpoint_cost() {
  dir=$(record 1gpu)_checkpoint_cost
  prepare || return
  mkdir -p "$dir"
  timeout -k 15 $((BUDGET - SECONDS - 15)) python3 experiments/parity/checkpoint_cost.py --out "$dir/cost.json" "$@" \
    2>&1 | tee "$dir/cost.log"
}

gpu_test() {
  dir=$(record 1gpu)_gpu_test
  mkdir -p "$dir"
  timeout $((BUDGET - SECONDS)) python3 -m pytest -m gpu tests/test_determinism.py -q -rs -p no:cacheprovider "$@" \
    2>&1 | tee "$dir/pytest.log"
}

case "${1:-}" in
one_gpu | deterministic | checkpoint_cost | gpu_test) "$1" "${@:2}" ;;
*) echo "usage: $0 one_gpu|deterministic|checkpoint_cost|gpu_test [OVERRIDES...]" >&2; exit 2 ;;
esac
pack "$dir"
