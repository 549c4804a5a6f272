"""The fused gpu backend's Triton kernels, run on CPU by Triton's interpreter (TRITON_INTERPRET=1, in a child
process so no other test sees interpreted kernels): at EP=1 the whole gpu backend, grouped GEMMs included, equals the
reference backend forward and backward, with skewed routing and an expert that gets no token. At EP=2 and 4 (gloo
ranks) it runs its peer paths over a CPU stand-in for symmetric memory (``FileSymmetricMemory``) and equals the
reference backend under balanced, skewed, all-to-the-same-experts and half-idle routing, its buffers and residuals
following the rows each rank receives, its symmetric workspace the largest receive buffer of the group rounded up the
1.25x ladder, grown once and reused."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.distributed as dist

from tests.fused_cases import bf16_op
from tests.interpreted import interpreted

pytest.importorskip("triton")

E, H, I, K, T = 8, 24, 40, 3, 33  # I > the kernels' column block would be too slow interpreted; 40 is not a power of 2


def compare_backends() -> list[float]:
    import moe_lab.moe.fused  # noqa: F401

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    gate_up_proj, down_proj = torch.randn(E, 2 * I, H, generator=gen) * 0.3, torch.randn(E, H, I, generator=gen) * 0.3
    law = (torch.arange(E - 1, dtype=torch.float64) + 1) ** -1.5  # skewed over experts 0..6; expert 7 idle
    ids = torch.multinomial(law.expand(T, -1), K, generator=gen)
    weights, grad_out = torch.rand(T, K, generator=gen), torch.randn(T, H, generator=gen)
    results = {}
    for backend in ("reference", "gpu"):
        inputs = [t.clone().requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]
        y = bf16_op(inputs[0], ids, *inputs[1:], E, "", backend)[0]
        results[backend] = [y, *torch.autograd.grad(y, inputs, grad_out)]
    assert results["gpu"][3][7].abs().max() == 0 and results["gpu"][4][7].abs().max() == 0
    return [(g - r).abs().max().item() / r.abs().max().item() for g, r in zip(results["gpu"], results["reference"])]


@pytest.mark.slow
def test_gpu_backend_interpreted_matches_reference():
    assert max(interpreted("tests.test_fused_kernels:compare_backends")) < 1e-5


def routing_weight_gradient_check() -> tuple[str, float]:
    """The gpu backend's backward called as the op calls it, with bf16 activations and weights and fp32 routing
    weights: the routing weights' gradient (each slot's expert output, unweighted, dotted with dy) -> (its dtype,
    its largest error relative to plain torch in fp32)."""
    import torch.nn.functional as F

    from tests.fused_cases import backend_pass

    experts, top_k, tokens = 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, H, generator=gen).bfloat16()
    gate_up_proj = (torch.randn(experts, 2 * I, H, generator=gen) * 0.3).bfloat16()
    down_proj = (torch.randn(experts, H, I, generator=gen) * 0.3).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights, dy = torch.rand(tokens, top_k, generator=gen), torch.randn(tokens, H, generator=gen).bfloat16()
    d_weights = backend_pass("gpu", x, ids, weights, gate_up_proj, down_proj, dy, experts, None)[2][1]
    expected = torch.empty(tokens, top_k)
    for t, k in itertools.product(range(tokens), range(top_k)):
        e = ids[t, k]
        gate, up = (gate_up_proj[e].float() @ x[t].float()).chunk(2)
        expected[t, k] = dy[t].float() @ (down_proj[e].float() @ (F.silu(gate) * up))
    return str(d_weights.dtype), ((d_weights.float() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.slow
def test_routing_weight_gradient_is_fp32_interpreted():
    """The routing weights' gradient is combined in fp32, the dtype the op's fake (and the router's fp32 weights)
    declare, not in dy's bf16; its values are those of plain torch up to the bf16 rounding of the activations."""
    dtype, error = interpreted("tests.test_fused_kernels:routing_weight_gradient_check", timeout=120)
    assert dtype == "torch.float32" and error < 2e-2, (dtype, error)


def zero_idle_experts_check() -> bool:
    import triton

    from moe_lab.moe.fused import kernels

    out = torch.ones(4, 3, 50)
    offs = torch.tensor([8, 8, 16, 16], dtype=torch.int32)  # experts 1 and 3 have no rows
    kernels.zero_idle_experts_kernel[(4, 3)](out, offs, SLAB=150, PER_PROGRAM=triton.cdiv(150, 3), BLOCK=32)
    return bool((out[[1, 3]] == 0).all() and (out[[0, 2]] == 1).all())


@pytest.mark.slow
def test_zero_idle_experts_interpreted():
    assert interpreted("tests.test_fused_kernels:zero_idle_experts_check", timeout=120) is True


def layout_kernels_check() -> str:
    """The gpu backend's layout kernels against the torch layout (``layout_from_counts``): every slot's row, each
    expert's segment end, the buffer sizes; at EP 1 and 8, every routing of the tests, alignments 1, 8 and 128, more
    slots than one program's block; and DeepGEMM's row map against searchsorted."""
    import triton

    from moe_lab.moe.fused import gpu, kernels
    from moe_lab.moe.fused.layout import layout_from_counts
    from tests.fused_cases import ROUTINGS, routing

    experts, top_k, tokens = 24, 4, 37  # 148 slots: two blocks of 128; 24 experts: not a power of 2
    for ep, kind, align in itertools.product((1, 8), ROUTINGS, (1, 8, 128)):
        all_ids = [routing(kind, r, tokens, experts, top_k) for r in range(ep)]
        blocks = [gpu.slot_counts(ids, experts) for ids in all_ids]
        all_counts = torch.stack([cum[:, -1] for _, cum in blocks])
        layouts = [gpu.layout_from_block_counts(all_ids[r], *blocks[r], all_counts, r, align) for r in range(ep)]
        for rank, actual in enumerate(layouts):
            expected = layout_from_counts(all_ids[rank], all_counts, rank, align)
            case = f"ep {ep} {kind} align {align} rank {rank}"
            assert torch.equal(actual.pos, expected.pos), case
            assert torch.equal(actual.offs, expected.offs), case
            assert (actual.rows, actual.max_rows) == (expected.rows, expected.max_rows), case
            row_src = torch.full((actual.rows,), -1, dtype=torch.int64)  # the rows this rank receives, as owner
            for ids, layout in zip(all_ids, layouts):
                row_src[layout.pos[ids // (experts // ep) == rank]] = 0
            m_indices = torch.empty(actual.rows, dtype=torch.int32)
            local = actual.offs.numel()
            kernels.row_experts_kernel[(triton.cdiv(actual.rows, 64),)](
                m_indices, actual.offs, row_src, actual.rows, local, triton.next_power_of_2(local), BLOCK=64
            )
            rows = torch.arange(actual.rows, dtype=torch.int32)
            expert = torch.searchsorted(actual.offs, rows, right=True).to(torch.int32)
            assert torch.equal(m_indices, torch.where(row_src >= 0, expert, -1).to(torch.int32)), case
    return "ok"


@pytest.mark.slow
def test_layout_kernels_interpreted_match_torch_layout():
    assert interpreted("tests.test_fused_kernels:layout_kernels_check") == "ok"


class FileSymmetricMemory:
    """``moe_lab.moe.fused.gpu.symmetric_empty`` on CPU: each rank's buffer is a file that every rank maps shared,
    so a peer's buffer address is valid in this process and the interpreted kernels read and write it as they would
    over NVLink; the barrier is the group's, which orders everything on CPU. Records each allocation's shape."""

    def __init__(self, directory: str):
        self.directory, self.count, self.shapes = directory, itertools.count(), []

    def __call__(self, shape, dtype, device, group):
        rank, world, n, numel = dist.get_rank(group), dist.get_world_size(group), next(self.count), math.prod(shape)
        path = functools.partial("{}/{}.{}".format, self.directory, n)
        with open(path(rank), "wb") as f:
            f.truncate(numel * dtype.itemsize)
        dist.barrier(group)
        maps = [torch.from_file(path(r), shared=True, size=numel, dtype=dtype) for r in range(world)]
        self.shapes.append(tuple(shape))
        ptrs = torch.tensor([m.data_ptr() for m in maps], dtype=torch.int64)
        return maps[rank].view(shape), ptrs, functools.partial(self.barrier, group, maps)

    @staticmethod
    def barrier(group, maps):
        dist.barrier(group)  # ``maps`` rides along: the peers' mappings live as long as the buffer


# balanced first, the worst skew next (the workspace grows), then smaller cases it serves without allocating.
EP_ROUTINGS = ("balanced", "same_experts", "zipf", "half_idle")
EP_TOKENS = 16  # per rank: every interpreted program costs milliseconds


def compare_ep_rank(ep: int, directory: str) -> list[dict]:
    """Per routing, on this rank: the gpu backend's forward and backward (called directly, as the op does) against
    the reference backend's op, the sizes of what it made, and whether each backend's received rows are the rows
    its ``row_src`` names, each received slot once (every rank's x drawn again from its seed)."""
    import moe_lab.moe.fused.gpu as gpu
    from moe_lab.moe.fused.layout import workspace_rows
    from moe_lab.moe.fused.ops import align
    from tests.fused_cases import RowCounter, backend_pass, received_rows, routing

    memory = FileSymmetricMemory(directory)
    gpu.symmetric_empty = memory
    rank, group = dist.get_rank(), dist.group.WORLD
    local = slice(rank * E // ep, (rank + 1) * E // ep)
    gen = torch.Generator().manual_seed(0)
    gate_up_proj, down_proj = torch.randn(E, 2 * I, H, generator=gen) * 0.3, torch.randn(E, H, I, generator=gen) * 0.3
    gate_up_proj, down_proj = gate_up_proj[local].contiguous(), down_proj[local].contiguous()
    largest, results = 0, []
    for kind in EP_ROUTINGS:
        gen = torch.Generator().manual_seed(rank)
        x, weights = torch.randn(EP_TOKENS, H, generator=gen), torch.rand(EP_TOKENS, K, generator=gen)
        grad_out = torch.randn(EP_TOKENS, H, generator=gen)
        all_ids = [routing(kind, r, EP_TOKENS, E, K) for r in range(ep)]
        ids = all_ids[rank]
        inputs = [t.clone().requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]
        y, *ref_residuals = bf16_op(inputs[0], ids, *inputs[1:], E, group.group_name, "reference")
        expected = [y, *torch.autograd.grad(y, inputs, grad_out)]
        allocated = len(memory.shapes)
        with RowCounter() as counter:
            y, residuals, grads = backend_pass("gpu", x, ids, weights, gate_up_proj, down_proj, grad_out, E, group)
        x_routed, _, gate_up, row_weight, row_src = residuals[:5]
        errors = [(g - r).abs().max().item() / (r.abs().max().item() + 1e-6) for g, r in zip([y, *grads], expected)]
        received, rows = received_rows(all_ids, rank, ep, align("gpu"), E)
        all_x = torch.cat([torch.randn(EP_TOKENS, H, generator=torch.Generator().manual_seed(r)) for r in range(ep)])
        sources_named = all(
            torch.equal(routed[src >= 0], all_x[src[src >= 0]]) and int((src >= 0).sum()) == received
            for routed, src in ((x_routed, row_src), (ref_residuals[0].detach(), ref_residuals[4]))
        )
        largest = max(largest, *(received_rows(all_ids, r, ep, align("gpu"), E)[1] for r in range(ep)))
        results.append(
            {
                "kind": kind,
                "errors": errors,
                "sources_named": sources_named,
                "received": received,
                "rows": rows,
                "held": counter.max_rows,
                "residual_rows": {x_routed.shape[0], gate_up.shape[0], row_weight.shape[0], row_src.shape[0]},
                "workspace": gpu._Exchange._workspace_rows[(x.device, group.group_name)],
                "expected_workspace": workspace_rows(largest),
                "allocated": memory.shapes[allocated:],
            }
        )
    return results


def compare_ep(ep: int, directory: str) -> list:
    from tests.distributed import run_world

    return run_world(ep, compare_ep_rank, ep, directory)


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.slow
def test_gpu_backend_peer_paths_interpreted_match_reference(ep, tmp_path):
    per_rank = interpreted("tests.test_fused_kernels:compare_ep", ep, str(tmp_path), timeout=600)
    for rank, results in enumerate(per_rank):
        for step, r in enumerate(results):
            case = f"rank {rank} step {step} ({r['kind']})"
            assert max(r["errors"]) < 1e-5, f"{case}: relative errors y, dx, dweights, dgate_up, ddown = {r['errors']}"
            assert r["sources_named"], f"{case}: a received row is not x[row_src]"
            assert r["residual_rows"] == {r["rows"]} and r["rows"] <= max(8, r["received"] + (E // ep) * 7), case
            assert r["held"] <= max(r["rows"], EP_TOKENS * K), f"{case}: a tensor of {r['held']} rows"
            assert r["workspace"] == r["expected_workspace"], case
        # Receive-side buffers come at the workspace's size; it grows at the worst skew (every rank at once), and
        # the smaller cases after it allocate nothing.
        workspace = [{shape for shape in r["allocated"] if shape[0] == r["workspace"]} for r in results]
        assert workspace[0] and workspace[1] and not any(r["allocated"] for r in results[2:]), [
            r["allocated"] for r in results
        ]
