"""Token dispatchers: the ``dispatcher`` config group. Each option is one class.

The MoE block, which owns the experts, calls its dispatcher as
``dispatcher(x, topk_ids, topk_weights, gate_up_proj, down_proj) -> y`` with the rank's own tokens x [T, H], their
routing [T, K] and the stacked weights of the experts this rank holds ([L, 2I, H] and [L, H, I], L = E / EP). It
returns y[t] = sum_k w[t, k] * Expert_{id[t, k]}(x[t]), each expert evaluated on the rank that holds it. A dispatcher
takes weights, never a module.

Each class declares ``saved_ops``: the ops whose outputs ac=selective keeps, so that recompute never re-routes or
re-communicates (``moe_lab.parallel.ac``); and ``validate(cfg, target)`` rejects configurations it cannot run
where they are to run (``moe_lab.runtime.device.Target``) before anything is built.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Literal, NamedTuple

import torch
import torch.distributed as dist
from einops import rearrange

from moe_lab.moe import fused  # registers torch.ops.moe_lab.fused_moe
from moe_lab.moe.collectives import all_to_all_rows, exchange_counts
from moe_lab.moe.experts import compute_dtype, grouped_swiglu
from moe_lab.moe.fp8.quant import TILE
from moe_lab.moe.fused.ops import align, fused_moe_layer
from moe_lab.runtime.device import Target, deep_gemm_import_error
from moe_lab.runtime.errors import ConfigError
from moe_lab.runtime.host_read import to_host


class TokenDispatcher(abc.ABC):
    """What a ``dispatcher`` option is (the group's contract). Built from the config and validated (``validate``)
    before any process group exists; ``moe_lab.parallel.parallelize`` then hands it the EP group
    (``set_ep_group``) and gives ac=selective its ``saved_ops``; each MoE block calls it (``__call__``). The group
    is held as plain values the compiler keeps as constants; no group means every expert is local."""

    # The ops whose outputs ac=selective keeps beyond the generic ones, so recompute never re-routes or
    # re-communicates (the planner reads them too).
    saved_ops: ClassVar[frozenset]

    def __init__(self):
        self.set_ep_group(None)

    def set_ep_group(self, ep_group: dist.ProcessGroup | None) -> TokenDispatcher:
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.group_name = ep_group.group_name if self.ep_size > 1 else ""
        return self

    @abc.abstractmethod
    def __call__(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
    ) -> torch.Tensor:
        """y [T, H] for the rank's tokens x [T, H], their routing [T, K] and the local experts' stacked weights (the
        module docstring's contract)."""

    def validate(self, cfg, target: Target) -> None:  # noqa: B027 (not abstract: a dispatcher without rules inherits acceptance)
        """Refuse, with a ``ConfigError`` naming the key, a composed config this dispatcher cannot run on ``target``
        (shapes its GEMMs cannot take, a mesh its exchange cannot span); the default accepts every config."""


def check_fp8(cfg, target: Target, emulated: bool) -> None:
    """Where ``dispatcher.expert_precision=fp8`` can run: 128-multiple expert shapes always (the tiles); an emulation
    (plain PyTorch, the same quantization) anywhere; otherwise a CUDA GPU of compute capability 9.0+ with DeepGEMM (a
    planned GPU's profile says whether it runs FP8: ``moe_lab.plan``)."""
    key = "dispatcher.expert_precision"
    for name in ("hidden_size", "moe_intermediate_size"):
        if cfg.model[name] % TILE:
            raise ConfigError(
                f"model.{name}",
                f"{key}=fp8 quantizes in {TILE}-wide tiles: needs a multiple of {TILE}, got {cfg.model[name]}",
            )
    if emulated:
        return
    if not target.runs_on_cuda(cfg.trainer):
        raise ConfigError(
            key,
            "fp8 at dispatcher.backend=auto or gpu runs DeepGEMM's FP8 GEMMs on an SM90+ GPU; without CUDA only its "
            "emulation runs it (slowly), asked for by name: dispatcher=fused with dispatcher.backend=reference, or "
            "dispatcher=torch on CPU",
        )
    capability = target.compute_capability
    if capability is not None and capability < (9, 0):
        raise ConfigError(key, f"fp8 needs compute capability 9.0+ (Hopper), this GPU has {capability}; use bf16")
    if target.deep_gemm_error is not None:
        raise ConfigError(
            key, f"fp8 needs deep_gemm, which cannot be imported there ({target.deep_gemm_error}); use bf16"
        )


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor, how: str) -> torch.Tensor:
    """``x[perm]`` for a permutation ``perm`` with inverse ``inverse``. ``copy``: each row copied to its place, so
    autograd's backward is a gather (``grad[inverse]``); ``select``: ``x.index_select(0, perm)``, whose backward is a
    zero fill and a bf16 index_add with atomics (2.4 ms a [131,072 x 2,048] permutation on an H100: 340 ms of
    reference_30b's 2.5 s emulated step; experiments/emulate README). Plain ops either way, so a block compiles whole
    at EP's data-dependent row counts."""
    if how == "copy":
        return torch.empty_like(x).index_copy(0, inverse, x)
    return x.index_select(0, perm)


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


class DispatchMeta(NamedTuple):
    """What ``TorchDispatcher.dispatch`` hands to ``combine`` to bring the expert outputs home."""

    order: torch.Tensor  # [T*K]: the (token, k) slot of each expert-sorted row
    unsort: torch.Tensor  # [T*K]: its inverse, the row of each (token, k) slot among the expert-sorted slots
    topk_weights: torch.Tensor  # [T, K]
    # EP > 1 only (None at EP = 1):
    send_rows: torch.Tensor | None  # [EP] int64 on the host: slots sent to each EP rank
    recv_rows: torch.Tensor | None  # [EP] int64 on the host: rows received from each EP rank
    expert_major: torch.Tensor | None  # received rows, (source rank, expert) order -> (expert, source rank) order
    source_major: torch.Tensor | None  # its inverse


class TorchDispatcher(TokenDispatcher):
    """All-to-all over the EP group with plain PyTorch ops and grouped GEMMs: ``dispatch`` -> ``grouped_swiglu``
    -> ``combine``.

    Per layer: one all-to-all of per-expert counts, one device-to-host copy of the split sizes, the token
    all-to-all, a local permute from (source rank, expert) to expert-contiguous order, grouped GEMMs, and the
    reverse path. Works over gloo (CPU) and NCCL (GPU). The collectives are custom ops (``moe_lab.moe.collectives``),
    so a block compiles whole.

    ``permute``: how its permutations of rows run (``permute_rows``): ``copy`` (backward a gather) or ``select``
    (backward an index_add with atomics, as before ``copy`` existed: the records made then plan as ``select``).

    ``expert_precision``: ``bf16`` or ``fp8``: ``grouped_swiglu``'s two GEMMs in blockwise FP8
    (``moe_lab.moe.fp8.grouped.fp8_grouped_mm``: DeepGEMM on SM90+ over a 128-aligned layout sized without reading the
    counts, so no host sync is added; the emulation on CPU); the rows still travel in bf16.
    """

    saved_ops = frozenset(
        {
            torch.ops.aten.sort.stable,
            torch.ops.aten.sort.default,
            torch.ops.aten.bincount.default,
            torch.ops.moe_lab.exchange_counts.default,
            torch.ops.moe_lab.all_to_all_rows.default,
            # expert_precision=fp8: its experts' FP8 GEMMs and their weight copies (cached per step anyway)
            torch.ops.moe_lab.fp8_grouped_mm.default,
            torch.ops.moe_lab.fp8_expert_weights.default,
        }
    )

    def __init__(self, expert_precision: Literal["bf16", "fp8"] = "bf16", permute: Literal["copy", "select"] = "copy"):
        self.expert_precision, self.permute = expert_precision, permute
        super().__init__()

    def validate(self, cfg, target: Target) -> None:
        # torch._grouped_mm needs 16-byte aligned rows: a multiple of 8 elements covers bf16 and fp32.
        for key in ("hidden_size", "moe_intermediate_size"):
            if cfg.model[key] % 8:
                raise ConfigError(
                    f"model.{key}", f"the torch dispatcher's grouped GEMM needs a multiple of 8, got {cfg.model[key]}"
                )
        if self.expert_precision == "fp8":  # on CPU it emulates
            check_fp8(cfg, target, emulated=not target.runs_on_cuda(cfg.trainer))
            return
        # The compiler's shape rules for torch._grouped_mm (its meta kernel) accept bf16 only.
        if cfg.trainer.compile and not target.computes_in_bf16(cfg.trainer):
            raise ConfigError(
                "trainer.precision",
                "trainer.compile=true with the torch dispatcher needs bf16 (torch._grouped_mm compiles in bf16 only); set trainer.precision=bf16",
            )

    def __call__(self, x, topk_ids, topk_weights, gate_up_proj, down_proj):
        rows, tokens_per_expert, meta = self.dispatch(x, topk_ids, topk_weights, gate_up_proj.shape[0])
        expert_out = grouped_swiglu(rows, tokens_per_expert, gate_up_proj, down_proj, self.expert_precision)
        return self.combine(expert_out, meta)

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_local_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchMeta]:
        """-> rows for this rank's experts in expert-contiguous order, rows per local expert [L], and what
        ``combine`` needs."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # (token, k) slots sorted by global expert
        unsort = inverse_permutation(order)
        tokens_per_expert = torch.bincount(flat_ids, minlength=self.ep_size * num_local_experts)
        routed = gather_rows(x, order, unsort, top_k)
        if self.ep_size == 1:
            return routed, tokens_per_expert, DispatchMeta(order, unsort, topk_weights, None, None, None, None)
        ep, name, local = self.ep_size, self.group_name, num_local_experts
        # recv[src * local + e]: rows source rank `src` sends to this rank's local expert e.
        recv_per_expert = exchange_counts(tokens_per_expert, name)
        rows = torch.stack([tokens_per_expert.view(ep, local).sum(1), recv_per_expert.view(ep, local).sum(1)])
        send_rows, recv_rows = to_host(rows).unbind()  # the one device-to-host sync of the layer
        received = all_to_all_rows(routed, send_rows, recv_rows, name)
        # Received rows are ordered (source rank, expert); the grouped GEMM wants (expert, source rank).
        segment = torch.repeat_interleave(
            torch.arange(ep * local, device=routed.device), recv_per_expert, output_size=received.shape[0]
        )
        expert_major = torch.argsort((segment % local) * ep + segment // local, stable=True)
        source_major = inverse_permutation(expert_major)
        meta = DispatchMeta(order, unsort, topk_weights, send_rows, recv_rows, expert_major, source_major)
        return (
            permute_rows(received, expert_major, source_major, self.permute),
            recv_per_expert.view(ep, local).sum(0),
            meta,
        )

    def combine(self, expert_out: torch.Tensor, meta: DispatchMeta) -> torch.Tensor:
        """Expert outputs in ``dispatch``'s row order -> y [T, H]: back to the tokens' ranks, to (token, k) order,
        weighted and summed over k."""
        # permute_rows, not gather_rows: torch 2.11 fails to compile an autograd.Function's backward over EP's
        # data-dependent row counts under selective AC.
        if self.ep_size > 1:
            expert_out = permute_rows(expert_out, meta.source_major, meta.expert_major, self.permute)
            expert_out = all_to_all_rows(expert_out, meta.recv_rows, meta.send_rows, self.group_name)
        slots = rearrange(
            permute_rows(expert_out, meta.unsort, meta.order, self.permute),
            "(t k) h -> t k h",
            k=meta.topk_weights.shape[1],
        )
        return (slots * meta.topk_weights.unsqueeze(-1)).sum(dim=1)


class FusedDispatcher(TokenDispatcher):
    """Hands tokens, routing and the local expert weights to one custom op that dispatches, runs the SwiGLU
    experts and combines, forward and backward (``moe_lab.moe.fused``); the dispatcher itself moves nothing.

    ``backend``: ``reference`` (plain PyTorch, CPU or GPU), ``gpu`` (Triton kernels; CUDA only) or
    ``auto`` (gpu for CUDA tensors, else reference). ``gemm`` picks the gpu backend's grouped GEMMs: ``deep_gemm``,
    ``torch`` (``torch._grouped_mm``) or ``auto`` (deep_gemm when importable and EP=1, else torch; see
    ``gpu_backend``). Either backend's buffers and saved tensors follow the rows the rank
    receives, at the cost of one host sync per forward (``moe_lab.moe.fused.layout``). ``save``: what the op keeps
    for backward (``moe_lab.moe.fused.ops.SAVES``): ``rows`` (the received rows and gate/up), ``rows_only`` (the
    rows; gate/up recomputed in backward), ``gate_up`` (gate/up; backward gathers the rows again, from the peers'
    symmetric memory at EP > 1) or ``inputs`` (neither: backward gathers the rows again and recomputes gate/up).

    ``expert_precision``: ``bf16`` (the compute dtype) or ``fp8``: the routed experts' GEMMs in blockwise FP8 (the
    same op, ``moe_lab.moe.fused.ops``; the gpu backend with DeepGEMM on SM90+, or the reference backend's
    emulation), with every ``save`` mode: where it keeps rows they are FP8 with their scales, gate/up stays bf16.
    ``wgrad_precision``: the experts' weight gradients' GEMMs: ``bf16`` (at fp8, on the kept rows dequantized) or, at
    ``expert_precision=fp8`` only, ``fp8`` (DeepGEMM's k-grouped FP8 kernel on the gpu backend, emulated by the
    reference one); bf16 by default, as FP8's measured slower end to end on the H200 (docs/fp8.md).
    """

    # The op returns what backward needs: saving its outputs means recompute re-runs none of it (the FP8 weight
    # copies are cached per step anyway).
    saved_ops = frozenset({torch.ops.moe_lab.fused_moe.default, torch.ops.moe_lab.fp8_expert_weights.default})

    def __init__(
        self,
        backend: Literal["auto", "reference", "gpu"] = "auto",
        gemm: Literal["auto", "deep_gemm", "torch"] = "auto",
        save: Literal["rows", "rows_only", "gate_up", "inputs"] = "rows",
        expert_precision: Literal["bf16", "fp8"] = "bf16",
        wgrad_precision: Literal["bf16", "fp8"] = "bf16",
    ):
        self.backend, self.gemm, self.save, self.expert_precision = backend, gemm, save, expert_precision
        self.wgrad_precision = wgrad_precision
        super().__init__()

    def set_ep_group(self, ep_group: dist.ProcessGroup | None) -> FusedDispatcher:
        super().set_ep_group(ep_group)
        # The gpu backend's GEMMs depend on the EP degree (gpu_backend); FP8 has DeepGEMM's only.
        cuda = self.backend != "reference" and torch.cuda.is_available()
        self.op_backend = self.gpu_backend(self.ep_size, deep_gemm_import_error()) if cuda else None
        return self

    def gpu_backend(self, ep: int, deep_gemm_error: str | None) -> str:
        """The op backend this option runs on a GPU at EP degree ``ep`` where deep_gemm fails to import with
        ``deep_gemm_error`` (None: it imports): ``moe_lab.moe.fused.gpu_backend_name`` for its ``gemm``, DeepGEMM's
        at fp8."""
        return fused.gpu_backend_name("deep_gemm" if self.expert_precision == "fp8" else self.gemm, ep, deep_gemm_error)

    def validate(self, cfg, target: Target) -> None:
        cuda = target.runs_on_cuda(cfg.trainer)
        if self.backend != "reference" and cfg.parallel.ep > target.ranks_per_node:
            raise ConfigError(
                "parallel.ep",
                f"the fused gpu backend exchanges rows through peer GPUs' memory over NVLink: its EP group must fit "
                f"in a node ({target.ranks_per_node} ranks per node), got {cfg.parallel.ep}; use dispatcher=torch "
                "across nodes",
            )
        if self.expert_precision == "fp8":
            if self.gemm == "torch":
                raise ConfigError(
                    "dispatcher.gemm", "expert_precision=fp8 runs DeepGEMM's FP8 GEMMs: use gemm=auto or deep_gemm"
                )
            check_fp8(cfg, target, emulated=self.backend == "reference")
        elif self.wgrad_precision == "fp8":
            raise ConfigError(
                "dispatcher.wgrad_precision",
                "fp8 weight gradients run on the FP8 experts' rows (the gpu backend's DeepGEMM k-grouped kernel, or "
                f"the reference backend's emulation): set expert_precision=fp8 or use bf16, got expert_precision="
                f"{self.expert_precision}",
            )
        if self.backend == "gpu" and not cuda:
            raise ConfigError(
                "dispatcher.backend",
                "gpu needs a CUDA device (trainer.device cuda or auto on a GPU machine); use reference or auto",
            )
        if self.gemm == "deep_gemm" and target.deep_gemm_error is not None:
            raise ConfigError(
                "dispatcher.gemm",
                f"deep_gemm cannot be imported there ({target.deep_gemm_error}); use torch or auto",
            )
        if self.backend == "reference" or not cuda:
            return
        multiple = align(self.gpu_backend(cfg.parallel.ep, target.deep_gemm_error))
        for key in ("hidden_size", "moe_intermediate_size"):
            if cfg.model[key] % multiple:
                raise ConfigError(
                    f"model.{key}",
                    f"the fused gpu backend's grouped GEMMs need a multiple of {multiple}, got {cfg.model[key]} "
                    "(dispatcher.backend=reference runs any size, slowly)",
                )

    def __call__(self, x, topk_ids, topk_weights, gate_up_proj, down_proj):
        dtype = compute_dtype(x)
        if self.backend == "reference" or (self.backend == "auto" and not x.is_cuda):
            backend = "reference"
        elif x.is_cuda and self.op_backend is not None:
            backend = self.op_backend
        else:
            raise RuntimeError(f"dispatcher.backend=gpu needs CUDA tensors, got {x.device}")
        return fused_moe_layer(
            x.to(dtype),
            topk_ids,
            topk_weights.to(dtype),
            gate_up_proj,
            down_proj,
            self.ep_size * gate_up_proj.shape[0],  # the global expert count
            self.group_name,
            backend,
            self.save,
            self.expert_precision,
            self.wgrad_precision,
        )
