"""Token dispatchers: the ``dispatcher`` config group. Each option is one class.

A dispatcher is called as ``dispatcher(x, topk_ids, topk_weights, experts) -> y`` with the rank's own tokens
x [T, H] and routing [T, K]; it returns y[t] = sum_k w[t, k] * Expert_{id[t, k]}(x[t]), each expert evaluated on
the rank that owns it. ``validate(cfg)`` rejects configurations it cannot run before anything is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.distributed as dist

from moe_lab.config.errors import ConfigError
from moe_lab.config.validate import computes_in_bf16, runs_on_cuda
from moe_lab.moe.collectives import all_to_all_rows, exchange_counts

if TYPE_CHECKING:
    from moe_lab.moe.layer import GroupedExperts


class TokenDispatcher(Protocol):
    def __call__(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: GroupedExperts
    ) -> torch.Tensor: ...

    def validate(self, cfg) -> None: ...


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, inverse, repeats):
        ctx.save_for_backward(inverse)
        ctx.repeats = repeats
        return x.index_select(0, perm // repeats if repeats > 1 else perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        if ctx.repeats > 1:
            grad = grad.view(-1, ctx.repeats, grad.shape[-1]).sum(dim=1)
        return grad, None, None, None


def gather_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor, repeats: int) -> torch.Tensor:
    """``x.repeat_interleave(repeats, 0)[perm]`` for a permutation ``perm`` with inverse ``inverse``, without the
    repeated copy. Its backward is a gather and a sum over the repeats: autograd's own for an index with repeated
    rows is a scatter-add, whose bf16 atomics contend at top-8 (38 ms of a 323 ms H200 step at seq 16384)."""
    return _GatherRows.apply(x, perm, inverse, repeats)


class TorchDispatcher:
    """All-to-all over the EP group with plain PyTorch ops and grouped GEMMs.

    Per layer: one all-to-all of per-expert counts, one device-to-host copy of the split sizes, the token
    all-to-all, a local permute from (source rank, expert) to expert-contiguous order, grouped GEMMs, and the
    reverse path. Works over gloo (CPU) and NCCL (GPU). The collectives are custom ops (``moe_lab.moe.collectives``),
    so a block compiles whole.
    """

    def __init__(self, ep_group: dist.ProcessGroup | None = None):
        self.ep_group = ep_group
        # Plain values the compiler can hold as constants.
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.group_name = ep_group.group_name if ep_group is not None else ""

    def validate(self, cfg) -> None:
        # torch._grouped_mm needs 16-byte aligned rows: a multiple of 8 elements covers bf16 and fp32.
        for key in ("hidden_size", "moe_intermediate_size"):
            if cfg.model[key] % 8:
                raise ConfigError(f"model.{key}", f"the torch dispatcher's grouped GEMM needs a multiple of 8, got {cfg.model[key]}")
        # The compiler's shape rules for torch._grouped_mm (its meta kernel) accept bf16 only.
        if cfg.trainer.compile and not computes_in_bf16(cfg.trainer):
            raise ConfigError("trainer.precision", "trainer.compile=true with the torch dispatcher needs bf16 (torch._grouped_mm compiles in bf16 only); set trainer.precision=bf16")

    def __call__(self, x, topk_ids, topk_weights, experts):
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (token, k) slots sorted by global expert
        unorder = inverse_permutation(order)
        tokens_per_expert = torch.bincount(flat_ids, minlength=experts.num_experts)
        routed = gather_rows(x, order, unorder, top_k)
        if self.ep_size == 1:
            out = experts.compute(routed, tokens_per_expert)
        else:
            out = self._exchange_and_compute(routed, tokens_per_expert, experts)
        # Back to (token, k) order, weight, and sum over k. This gather and the two in _exchange_and_compute are
        # plain: a permutation's backward scatter-add has no repeated rows to contend on, and torch 2.11 fails to
        # compile gather_rows' backward over EP's data-dependent row counts under selective AC.
        unsorted = out.index_select(0, unorder)
        return (unsorted.view(num_tokens, top_k, -1) * topk_weights.unsqueeze(-1)).sum(dim=1)

    def _exchange_and_compute(self, routed, tokens_per_expert, experts):
        ep, name, local = self.ep_size, self.group_name, experts.num_local_experts
        # recv[src * local + e]: rows source rank `src` sends to this rank's local expert e.
        recv_per_expert = exchange_counts(tokens_per_expert, name)
        rows = torch.stack([tokens_per_expert.view(ep, local).sum(1), recv_per_expert.view(ep, local).sum(1)])
        send_rows, recv_rows = rows.cpu().unbind()  # the one device-to-host sync of the layer
        received = all_to_all_rows(routed, send_rows, recv_rows, name)
        # Received rows are ordered (source rank, expert); the grouped GEMM wants (expert, source rank).
        segment = torch.repeat_interleave(
            torch.arange(ep * local, device=routed.device), recv_per_expert, output_size=received.shape[0]
        )
        perm = torch.argsort((segment % local) * ep + segment // local, stable=True)
        out = experts.compute(received.index_select(0, perm), recv_per_expert.view(ep, local).sum(0))
        out = out.index_select(0, inverse_permutation(perm))
        return all_to_all_rows(out, recv_rows, send_rows, name)


class FusedDispatcher:
    """Hands tokens, routing and the local expert weights to one custom op that dispatches, runs the SwiGLU
    experts and combines (``moe_lab.moe.fused``); the dispatcher itself moves nothing.

    ``backend``: ``reference`` (plain PyTorch, CPU or GPU), ``gpu`` (Triton kernels, no host sync; CUDA only) or
    ``auto`` (gpu for CUDA tensors, else reference). ``gemm`` picks the gpu backend's grouped GEMMs: ``deep_gemm``,
    ``torch`` (``torch._grouped_mm``) or ``auto`` (deep_gemm when importable and EP=1, else torch; see
    ``moe_lab.moe.fused.gpu_backend_name``).
    """

    def __init__(
        self,
        backend: Literal["auto", "reference", "gpu"] = "auto",
        gemm: Literal["auto", "deep_gemm", "torch"] = "auto",
        ep_group: dist.ProcessGroup | None = None,
    ):
        from moe_lab.moe import fused  # registers the custom ops

        self.backend, self.gemm = backend, gemm
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.group_name = ep_group.group_name if ep_group is not None and self.ep_size > 1 else ""
        self._gpu_backend = fused.gpu_backend_name(gemm, self.ep_size) if backend != "reference" and torch.cuda.is_available() else None

    def validate(self, cfg) -> None:
        from moe_lab.moe import fused

        cuda = runs_on_cuda(cfg.trainer)
        if self.backend == "gpu" and not cuda:
            raise ConfigError("dispatcher.backend", "gpu needs a CUDA device (trainer.device cuda or auto on a GPU machine); use reference or auto")
        if self.gemm == "deep_gemm" and not fused.deep_gemm_available():
            raise ConfigError("dispatcher.gemm", f"deep_gemm cannot be imported here ({fused.deep_gemm_import_error()}); use torch or auto")
        if self.backend == "reference" or not cuda:
            return
        multiple = 128 if fused.gpu_backend_name(self.gemm, cfg.parallel.ep) == "gpu_deep_gemm" else 8
        for key in ("hidden_size", "moe_intermediate_size"):
            if cfg.model[key] % multiple:
                raise ConfigError(f"model.{key}", f"the fused gpu backend's grouped GEMMs need a multiple of {multiple}, got {cfg.model[key]}")

    def __call__(self, x, topk_ids, topk_weights, experts):
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        if self.backend == "reference" or (self.backend == "auto" and not x.is_cuda):
            backend = "reference"
        elif x.is_cuda and self._gpu_backend is not None:
            backend = self._gpu_backend
        else:
            raise RuntimeError(f"dispatcher.backend=gpu needs CUDA tensors, got {x.device}")
        y, *_ = torch.ops.moe_lab.fused_moe(
            x.to(dtype),
            topk_ids,
            topk_weights.to(dtype),
            experts.gate_up_proj.to(dtype),
            experts.down_proj.to(dtype),
            experts.num_experts,
            self.group_name,
            backend,
        )
        return y
