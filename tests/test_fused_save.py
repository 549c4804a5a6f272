"""dispatcher.save: what the fused op keeps for backward. ``rows_only`` (received rows; gate/up recomputed),
``gate_up`` (gate/up and x; rows gathered again) and ``inputs`` (x only; rows gathered again, gate/up recomputed)
give gradients bit for bit equal to ``rows``: backward recomputes the same rows and GEMMs forward ran, on the same
inputs, in the same order. At either expert precision: at fp8 the rows are quantized again from x, to the same bits.
Checked on the reference backend at EP=1 and over gloo at EP=2, on the gpu backend under Triton's interpreter at EP=1
and at EP=2 over the CPU stand-in for symmetric memory (FP8: tests/test_fp8.py), and for a decoder block compiled
with fullgraph=True under ac none, selective and full. What autograd saves shrinks accordingly: no tensor of the
received rows (nor, at fp8, their scales) with ``gate_up`` and ``inputs``, no gate/up with ``rows_only`` and
``inputs``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_lab.moe.dispatcher import FusedDispatcher
from moe_lab.moe.experts import GroupedExperts
from moe_lab.moe.router import Router
from moe_lab.parallel.ac import FullCheckpoint, NoCheckpoint, SelectiveCheckpoint
from moe_lab.parallel.expert_parallel import apply_expert_parallel, keep_local_experts
from tests.distributed import run_world
from tests.fused_cases import count_forwards, received_rows, routing, saved_shapes
from tests.interpreted import interpreted
from tests.test_fused_reference import E, K, T, forward_backward

SAVES = ("rows", "rows_only", "gate_up", "inputs")
# Expert shapes per precision: FP8 quantizes in 128-wide tiles.
SHAPES = {"bf16": (16, 12), "fp8": (128, 128)}


def make_problem(rank: int, kind: str, precision: str):
    """One rank's tokens, routing and output gradient at ``precision``'s shapes."""
    hidden = SHAPES[precision][0]
    gen = torch.Generator().manual_seed(100 + rank)
    x, weights = torch.randn(T, hidden, generator=gen), torch.rand(T, K, generator=gen)
    return x, routing(kind, rank, T, E, K), weights, torch.randn(T, hidden, generator=gen)


def make_experts(precision: str) -> GroupedExperts:
    hidden, inter = SHAPES[precision]
    experts = GroupedExperts(E, hidden, inter)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5, generator=gen)
        experts.down_proj.normal_(0, inter**-0.5, generator=gen)
    return experts


def grads_by_save(x, ids, weights, grad_out, experts: GroupedExperts, precision: str, group=None) -> dict:
    """save -> (y and the gradients, the shapes autograd saved)."""
    params = [experts.gate_up_proj, experts.down_proj]
    results = {}
    for save in SAVES:
        dispatcher = FusedDispatcher(backend="reference", save=save, expert_precision=precision)
        dispatcher.set_ep_group(group)
        got = []
        shapes = saved_shapes(
            lambda: got.extend(
                forward_backward(lambda x, w: dispatcher(x, ids, w, *params), x, weights, params, grad_out)
            )
        )
        results[save] = (got, shapes)
    return results


def assert_saves_agree(results: dict, rows: int, precision: str, case: str) -> None:
    hidden, inter = SHAPES[precision]
    expected, saved_rows = results["rows"]
    for save in SAVES[1:]:
        got, shapes = results[save]
        for name, g, e in zip(("y", "dx", "dweights", "dgate_up", "ddown"), got, expected):
            assert torch.equal(g, e), f"{case} save={save}: {name} differs from save=rows"
    # the received rows as kept: the values, and at fp8 their 1x128 scales
    kept_rows = {(rows, hidden)} | ({(rows, hidden // 128)} if precision == "fp8" else set())
    gate_up = (rows, 2 * inter)
    assert kept_rows | {gate_up} <= saved_rows, case
    assert kept_rows <= results["rows_only"][1] and gate_up not in results["rows_only"][1], case
    assert not kept_rows & results["gate_up"][1] and {gate_up, (T, hidden)} <= results["gate_up"][1], case
    assert not (kept_rows | {gate_up}) & results["inputs"][1] and (T, hidden) in results["inputs"][1], case


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", ["random", "zipf", "half_idle"])
def test_saves_equal_rows_at_ep1(kind, precision):
    x, ids, weights, grad_out = make_problem(0, kind, precision)
    results = grads_by_save(x, ids, weights, grad_out, make_experts(precision), precision)
    assert_saves_agree(results, received_rows([ids], 0, 1, 1, E)[1], precision, kind)


def _ep2_rank() -> list[str]:
    rank, ep = dist.get_rank(), dist.get_world_size()
    failures = []
    for precision in ("bf16", "fp8"):
        for kind in ("balanced", "zipf", "half_idle"):
            problems = [make_problem(r, kind, precision) for r in range(ep)]
            experts = make_experts(precision)
            keep_local_experts(experts, rank, ep)
            x, ids, weights, grad_out = problems[rank]
            results = grads_by_save(x, ids, weights, grad_out, experts, precision, dist.group.WORLD)
            rows = received_rows([p[1] for p in problems], rank, ep, 1, E)[1]
            try:
                assert_saves_agree(results, rows, precision, f"{precision} {kind}")
            except AssertionError as e:
                failures.append(str(e))
    return failures


def test_saves_equal_rows_gloo_ep2():
    assert run_world(2, _ep2_rank) == [[], []]


def _tiny_model(save, ac, precision):
    from moe_lab.models.qwen3_moe import Qwen3MoeConfig

    hidden, inter = SHAPES[precision] if precision == "fp8" else (32, 16)
    cfg = Qwen3MoeConfig.preset(
        "tiny", num_layers=1, hidden_size=hidden, num_heads=2, num_kv_heads=1, head_dim=16, moe_intermediate_size=inter
    )
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    dispatcher = FusedDispatcher(backend="reference", save=save, expert_precision=precision)
    apply_expert_parallel(model, dispatcher, 0, 1)
    ac.apply(model, saved_ops={"router": Router.saved_ops, "dispatcher": dispatcher.saved_ops})
    layer = model.model.layers[0]
    layer.forward = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")  # as apply_compile does
    return model


@pytest.mark.parametrize(
    "ac, precision",
    [(NoCheckpoint, "bf16"), (SelectiveCheckpoint, "bf16"), (FullCheckpoint, "bf16"), (SelectiveCheckpoint, "fp8")],
)
def test_block_compiles_fullgraph_with_save_inputs(ac, precision, monkeypatch):
    """One graph per block with save=inputs under every AC mode (FP8: selective, where what the op keeps is what the
    block keeps), gradients equal save=rows'; the op runs once per forward (twice under full AC: its recompute),
    never again in backward, whatever it saved."""
    calls = count_forwards(monkeypatch)
    tokens = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(3))
    grads = {}
    for save in ("rows", "inputs"):
        torch._dynamo.reset()
        model = _tiny_model(save, ac(), precision)
        calls.clear()
        model(tokens).logits.square().mean().backward()
        assert len(calls) == (2 if ac is FullCheckpoint else 1), save
        grads[save] = {name: p.grad for name, p in model.named_parameters()}
    for name, g in grads["rows"].items():
        assert torch.equal(grads["inputs"][name], g), name


# --- the gpu backend under Triton's interpreter --------------------------------------------------------------------


def gpu_saves_check(group=None, tokens: int = 17) -> list[str]:
    """On this rank: the gpu backend's forward and backward under each save, as the op calls them; what differs from
    save=rows, and whether save=inputs returned no received rows. 17 tokens (51 slots, one layout block, as 33 were;
    the multi-block layout is tests/test_fused_kernels.py's): each interpreted row costs milliseconds."""
    from moe_lab.moe.fused.ops import BACKENDS
    from moe_lab.moe.fused.ops import SAVES as KEPT

    gpu = BACKENDS["gpu"]

    E_, H_, I_, K_ = 8, 24, 40, 3  # as tests/test_fused_kernels.py: 40 is not a power of 2
    rank, ep = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    gen = torch.Generator().manual_seed(0)
    gate_up_proj, down_proj = (
        torch.randn(E_, 2 * I_, H_, generator=gen) * 0.3,
        torch.randn(E_, H_, I_, generator=gen) * 0.3,
    )
    local = slice(rank * E_ // ep, (rank + 1) * E_ // ep)
    gate_up_proj, down_proj = gate_up_proj[local].contiguous(), down_proj[local].contiguous()
    failures = []
    for kind in ("zipf", "half_idle"):
        gen = torch.Generator().manual_seed(rank)
        x, weights = torch.randn(tokens, H_, generator=gen), torch.rand(tokens, K_, generator=gen)
        grad_out = torch.randn(tokens, H_, generator=gen)
        ids = routing(kind, rank, tokens, E_, K_)
        results = {}
        for save in SAVES:
            y, *residuals = gpu.forward(x, ids, weights, gate_up_proj, down_proj, [], E_, group, KEPT[save], "bf16")
            grads = gpu.backward(grad_out, residuals, ids, gate_up_proj, down_proj, [], group, "bf16", x)
            results[save] = [y, *grads]
            if save == "inputs" and residuals[0].shape[0] + residuals[2].shape[0]:
                failures.append(f"{kind}: save=inputs returned received rows")
            if save == "gate_up" and (residuals[0].shape[0] or not residuals[2].shape[0]):
                failures.append(f"{kind}: save=gate_up returned received rows or no gate/up")
        for save in SAVES[1:]:
            for name, g, e in zip(("y", "dx", "dweights", "dgate_up", "ddown"), results[save], results["rows"]):
                if not torch.equal(g, e):
                    failures.append(f"{kind} save={save}: {name} differs by {(g - e).abs().max().item()}")
    return failures


def gpu_saves_ep_rank(directory: str) -> list[str]:
    import moe_lab.moe.fused.gpu as gpu
    from tests.test_fused_kernels import FileSymmetricMemory

    gpu.symmetric_empty = FileSymmetricMemory(directory)
    return gpu_saves_check(dist.group.WORLD, tokens=16)


def gpu_saves_ep(directory: str) -> list:
    return run_world(2, gpu_saves_ep_rank, directory)


@pytest.mark.slow
def test_gpu_backend_saves_interpreted_equal_rows():
    assert interpreted("tests.test_fused_save:gpu_saves_check", timeout=600) == []


@pytest.mark.slow
def test_gpu_backend_saves_interpreted_equal_rows_peer_paths(tmp_path):
    """At EP=2 save=inputs pulls the rows again from the peers' (file-mapped) x buffers in backward."""
    assert interpreted("tests.test_fused_save:gpu_saves_ep", str(tmp_path), timeout=600) == [[], []]
