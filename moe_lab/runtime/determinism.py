"""``trainer.deterministic``: the process-wide switches that make a run repeat bit for bit (docs/determinism.md).

moe_lab's own ops need no switch of their own: none of its Triton kernels uses an atomic (the fused op's combine is a
gather-sum over each token's K rows in a fixed order, its dispatch writes each received row once, its weight
gradients are grouped GEMMs), and the torch dispatcher's permutations (``index_copy`` forward and a gather backward,
or ``permute=select``'s index_add backward) write or add one value per row: exact in any order, and torch's
deterministic variants under ``use_deterministic_algorithms``.
tests/test_determinism.py holds the kernels to that.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

# cuBLAS picks a reduction order per call from its workspace unless the workspace is fixed (CUDA's documented
# setting); it reads this when it creates its first handle, so it must be set before the first GPU matmul.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def inductor_has_deterministic_mode() -> bool:
    """Whether this torch's Inductor can skip the on-device benchmarking that picks kernel configurations (and with
    them a reduction order) anew in each process."""
    import torch._inductor.config as inductor

    return hasattr(inductor, "deterministic")


def set_determinism(deterministic: bool, seed: int) -> None:
    """Switch the process into (or, for a later point of a sweep, back out of) deterministic mode: torch's
    deterministic algorithms (an op without one raises), cuDNN without autotuning, Inductor's deterministic mode, the
    cuBLAS workspace fixed, and the global generators (python, numpy, torch on CPU and every GPU) seeded from
    ``seed``. The data options and weight init draw from generators of their own, seeded by their configs. Call it
    before any CUDA work."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # and every CUDA device's generator
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False
    if inductor_has_deterministic_mode():
        import torch._inductor.config as inductor

        inductor.deterministic = deterministic
