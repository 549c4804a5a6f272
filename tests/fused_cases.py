"""Routings, size probes and validation targets shared by the fused op's tests (reference backend, interpreted
kernels, GPU, FP8)."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lab.runtime.device import Target

ROUTINGS = ("random", "balanced", "zipf", "same_experts", "half_idle")


def routing(kind: str, rank: int, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """[tokens, top_k] distinct experts per token, as a router picks them. random: uniform, expert 5 never picked;
    balanced: round robin; zipf: Zipf 1.5 over expert ids; same_experts: every token of every rank picks experts
    0..K-1 (the fewest experts and ranks that can take every row: the old worst case); half_idle: round robin over
    the first half of the experts (at EP >= 2 whole ranks receive nothing)."""
    gen = torch.Generator().manual_seed(200 + rank)
    slots = torch.arange(tokens * top_k) + rank * tokens * top_k
    if kind == "random":
        allowed = torch.tensor([e for e in range(experts) if e != 5])
        return torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)])
    if kind == "balanced":
        return slots.remainder(experts).view(tokens, top_k)
    if kind == "half_idle":
        return slots.remainder(experts // 2).view(tokens, top_k)
    if kind == "same_experts":
        return torch.arange(top_k).expand(tokens, top_k).clone()
    law = (torch.arange(experts, dtype=torch.float64) + 1) ** -1.5
    return torch.multinomial(law.expand(tokens, -1), top_k, generator=gen)


def received_rows(all_ids: list[torch.Tensor], rank: int, ep: int, align: int, experts: int) -> tuple[int, int]:
    """(rows every rank routes to rank ``rank``'s experts, its receive buffer's rows: each local expert's count
    rounded up to ``align``, at least ``align``), from every rank's routing."""
    local = experts // ep
    counts = torch.bincount(torch.cat(all_ids).reshape(-1), minlength=experts)[rank * local : (rank + 1) * local]
    return int(counts.sum()), max(align, int(((counts + align - 1) // align * align).sum()))


class RowCounter(TorchDispatchMode):
    """The most rows any tensor made under it holds (elements over the last dimension), leaving out 3-d weight
    gradients [L, N, K], views and in-place ops (they allocate nothing; Triton's interpreter copies whole storages
    with the latter) and ``aten.from_file`` (the CPU stand-in for symmetric memory, checked on its own)."""

    def __init__(self):
        super().__init__()
        self.max_rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = not (
            func.is_view or func.overloadpacket.__name__.endswith("_") or func is torch.ops.aten.from_file.default
        )
        if made:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and 0 < t.dim() < 3:
                    self.max_rows = max(self.max_rows, t.numel() // max(t.shape[-1], 1) if t.dim() == 2 else t.numel())
        return out


def buffer_rows(backend: str, x, ids, weights, gate_up_proj, down_proj, grad_out, num_experts: int, group) -> int:
    """The most rows any tensor made by one forward and backward of the op's ``backend`` (bf16, save=rows) holds."""
    with RowCounter() as counter:
        backend_pass(backend, x, ids, weights, gate_up_proj, down_proj, grad_out, num_experts, group)
    return counter.max_rows


def saved_shapes(fn) -> set[tuple[int, ...]]:
    """Shapes of the tensors autograd saves while ``fn()`` runs."""
    shapes = set()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.add(tuple(t.shape)) or t, lambda t: t):
        fn()
    return shapes


CPU = Target(world_size=1, ranks_per_node=1, device_type="cpu", compute_capability=None, deep_gemm_error=None)
HOPPER = dataclasses.replace(CPU, device_type="cuda", compute_capability=(9, 0))


def validation_error(dispatcher, target: Target = CPU, hidden=64, inter=32, device="auto", ep=1) -> str | None:
    """The key ``dispatcher.validate`` names for a config of these expert shapes on ``target``; None if it passes."""
    from omegaconf import OmegaConf

    from moe_lab.runtime.errors import ConfigError

    cfg = OmegaConf.create(
        {
            "trainer": {"device": device, "nproc_per_node": target.world_size, "precision": "auto", "compile": False},
            "parallel": {"ep": ep},
            "model": {"hidden_size": hidden, "moe_intermediate_size": inter},
        }
    )
    try:
        dispatcher.validate(cfg, target)
    except ConfigError as e:
        return e.key
    return None


def count_forwards(monkeypatch, backend: str = "reference") -> list:
    """Record a call per forward of the op's ``backend`` (the list it returns grows by one each)."""
    from moe_lab.moe.fused.ops import BACKENDS

    calls, impl = [], BACKENDS[backend]
    forward = functools.partial(lambda f, *a: calls.append(1) or f(*a), impl.forward)
    monkeypatch.setitem(BACKENDS, backend, dataclasses.replace(impl, forward=forward))
    return calls


def bf16_op(x, ids, weights, gate_up_proj, down_proj, num_experts, group_name, backend, save="rows"):
    """``torch.ops.moe_lab.fused_moe`` at bf16 (the stacks as given, no weight copies)."""
    return torch.ops.moe_lab.fused_moe(
        x, ids, weights, gate_up_proj, down_proj, [], num_experts, group_name, backend, save, "bf16", "bf16"
    )


def backend_pass(backend, x, ids, weights, gate_up_proj, down_proj, grad_out, num_experts, group, save="rows"):
    """A backend's forward and backward at bf16, called as the op calls them -> (y, residuals, gradients)."""
    from moe_lab.moe.fused.ops import BACKENDS, SAVES

    impl = BACKENDS[backend]
    y, *residuals = impl.forward(x, ids, weights, gate_up_proj, down_proj, [], num_experts, group, SAVES[save], "bf16")
    grads = impl.backward(grad_out, residuals, ids, gate_up_proj, down_proj, [], group, "bf16", x)
    return y, residuals, grads
