"""The fused dispatcher's op: token dispatch + SwiGLU experts + combine, forward and backward (see ``ops``), at
either expert precision; importing the package registers the op and every backend (``reference``, ``gpu``)."""

from __future__ import annotations

import logging

from moe_lab.moe.fused import gpu, ops, reference  # noqa: F401  (register torch.ops.moe_lab.fused_moe, its backends)

log = logging.getLogger(__name__)


def gpu_backend_name(gemm: str, ep: int, deep_gemm_error: str | None) -> str:
    """The op backend for the gpu path with this ``gemm`` choice at EP degree ``ep``, where deep_gemm fails to
    import with ``deep_gemm_error`` (None: it imports; ``moe_lab.runtime.device.Target``).

    auto: deep_gemm when importable and EP=1, else torch. DeepGEMM's contiguous layout runs over the whole receive
    buffer, and at EP>1 that buffer held the worst case (EP x the average rows): on two H200s its GEMMs took twice
    their EP=1 time, while ``torch._grouped_mm`` stops at the last expert's rows (experiments/moe_layer/records/h200_ep2/).
    The buffer now holds the rows received (``moe_lab.moe.fused.layout``), which removes that reason; the choice stays
    until DeepGEMM at EP>1 is measured again.
    """
    if not (gemm == "deep_gemm" or (gemm == "auto" and ep == 1)):
        return "gpu"
    if deep_gemm_error is None:
        return "gpu_deep_gemm"
    if gemm == "deep_gemm":
        raise RuntimeError(f"dispatcher.gemm=deep_gemm, but deep_gemm cannot be imported: {deep_gemm_error}")
    log.warning("deep_gemm is not importable (%s); the fused gpu backend uses torch._grouped_mm", deep_gemm_error)
    return "gpu"
