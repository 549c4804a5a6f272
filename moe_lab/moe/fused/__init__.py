"""The fused dispatcher's op: token dispatch + SwiGLU experts + combine, forward and backward (see ``ops``)."""

from __future__ import annotations

import functools
import importlib
import logging

from moe_lab.moe.fused import fp8_ops, ops  # noqa: F401  (register torch.ops.moe_lab.fused_moe*)

log = logging.getLogger(__name__)


@functools.cache
def deep_gemm_import_error() -> str | None:
    try:
        importlib.import_module("deep_gemm")
    except Exception as e:  # ImportError, or a CUDA/toolkit error raised while it loads
        return f"{type(e).__name__}: {e}"
    return None


def deep_gemm_available() -> bool:
    return deep_gemm_import_error() is None


def wants_deep_gemm(gemm: str, ep: int = 1) -> bool:
    """Whether the gpu backend runs DeepGEMM's grouped GEMMs with this ``gemm`` choice at EP degree ``ep`` where
    deep_gemm imports (``gpu_backend_name``'s rule; the planner plans a GPU machine by it)."""
    return gemm == "deep_gemm" or (gemm == "auto" and ep == 1)


def gpu_backend_name(gemm: str, ep: int = 1) -> str:
    """The op backend for the gpu path with this ``gemm`` choice.

    auto: deep_gemm when importable and EP=1, else torch. DeepGEMM's contiguous layout runs over the whole receive
    buffer, and at EP>1 that buffer held the worst case (EP x the average rows): on two H200s its GEMMs took twice
    their EP=1 time, while ``torch._grouped_mm`` stops at the last expert's rows (experiments/moe_layer/records/h200_ep2/).
    The buffer now holds the rows received (``moe_lab.moe.fused.layout``), which removes that reason; the choice stays
    until DeepGEMM at EP>1 is measured again.
    """
    if not wants_deep_gemm(gemm, ep):
        return "gpu"
    if deep_gemm_available():
        return "gpu_deep_gemm"
    if gemm == "deep_gemm":
        raise RuntimeError(f"dispatcher.gemm=deep_gemm, but deep_gemm cannot be imported: {deep_gemm_import_error()}")
    log.warning(
        "deep_gemm is not importable (%s); the fused gpu backend uses torch._grouped_mm", deep_gemm_import_error()
    )
    return "gpu"
