#!/usr/bin/env bash
# Rebuilds .whl/ (git-ignored): every wheel the offline GPU machines (Python 3.12, x86-64, torch 2.11 image; package
# list in the device KINDS.md) lack, for moe_lab and for the torchtitan baseline (experiments/torchtitan_baseline/torchtitan_baseline.py).
# On the device: carry=[".whl"] and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
# Versions are pinned (one version of each: two stop the --no-deps install). About 23 MiB in all (10 of them the
# probe's DeepGEMM candidates), under the 64 MiB a device call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl

download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}

# moe_lab: Hydra and its parser runtime (antlr4 4.9.3 is published as an sdist only: built into a pure wheel here)
download hydra-core==1.3.8 omegaconf==2.3.1
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
# moe_lab's fused dispatcher: DeepGEMM's grouped GEMMs for torch 2.11
download sgl-deep-gemm==0.1.5.post1 apache-tvm-ffi==0.1.11
# precision=fp8's dense linears: torchao's float8 training (0.18.0 supports torch >= 2.11; one abi3 wheel, no deps)
download torchao==0.18.0
# experiments/fp8/kernel_probe.py's other DeepGEMM candidates, each installed in its own --target folder by the probe
# (kept out of .whl/*.whl: two versions there stop the --no-deps install): 0.2.1, the newest whose _C.so links no
# c10::cuda::CUDAErrorLogCapture (0.2.1.post1 and later do: torch 2.11 lacks it), and 0.2.5, the newest. Measured
# on the H200 (experiments/fp8/README.md, kernel choice): 0.2.1's calls misread torch 2.11's tensors and 0.2.5 does
# not load; every release after 0.1.5.post1 was built against a newer torch, so 0.1.5.post1 stays pinned above.
download_to() { local dir=$1; shift; mkdir -p "$dir"; download "$@"; mv .whl/sgl_deep_gemm-"${1#*==}"-*.whl "$dir"/; }
download_to .whl/kernel_probe sgl-deep-gemm==0.2.1
download_to .whl/kernel_probe sgl-deep-gemm==0.2.5

# torchtitan 0.2.2 (the release for torch 2.11) and the requirements the image lacks. Already in the image:
# tokenizers, tensorboard, einops, pillow, fsspec, pyarrow, pandas, xxhash, huggingface-hub, requests, pyyaml;
# tomli is not needed on Python 3.12 (torchtitan reads TOML with tomllib).
download torchtitan==0.2.2 torchdata==0.11.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1

du -sh .whl
ls -R .whl
