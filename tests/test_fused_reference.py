"""dispatcher=fused, reference backend: equals a dense per-token loop and the torch dispatcher, forward and backward,
at EP=1 and over gloo at EP=2 and 4, under balanced, Zipf-skewed, all-to-the-same-experts and half-idle routing; a
decoder block with it compiles with fullgraph=True under full and selective activation checkpointing and matches eager.

Memory follows the rows received (issue 15): the op's residuals (what autograd saves) have exactly as many rows as
this rank receives, each expert's padded to the alignment (at least one aligned block); no tensor the op makes holds
more rows than the larger of that and the slots it sends; at EP=8 the layout gives every rank that size and places
every source's rows inside it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from moe_lab.moe.dispatcher import FusedDispatcher, TorchDispatcher
from moe_lab.moe.experts import GroupedExperts
from moe_lab.moe.router import Router
from moe_lab.parallel.ac import FullCheckpoint, SelectiveCheckpoint
from moe_lab.parallel.expert_parallel import apply_expert_parallel, keep_local_experts
from tests.distributed import run_world
from tests.fused_cases import (
    HOPPER,
    ROUTINGS,
    buffer_rows,
    count_forwards,
    received_rows,
    routing,
    saved_shapes,
    validation_error,
)

E, H, I, K, T = 8, 16, 12, 3, 10


def make_problem(rank: int, kind: str = "random"):
    """One rank's tokens, routing and output gradient."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen)
    weights = torch.rand(T, K, generator=gen)
    grad_out = torch.randn(T, H, generator=gen)
    return x, routing(kind, rank, T, E, K), weights, grad_out


def make_experts() -> GroupedExperts:
    experts = GroupedExperts(E, H, I)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3, generator=gen)
        experts.down_proj.normal_(0, 0.3, generator=gen)
    return experts


def dense_reference(x, ids, weights, gate_up_proj, down_proj):
    """y[t] = sum_k w[t, k] * down_e @ (silu(gate_e @ x[t]) * (up_e @ x[t])), one token at a time."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1])
        for k in range(ids.shape[1]):
            e = ids[t, k]
            gate, up = (gate_up_proj[e] @ x[t]).chunk(2)
            acc = acc + weights[t, k] * (down_proj[e] @ (F.silu(gate) * up))
        rows.append(acc)
    return torch.stack(rows)


def forward_backward(fn, x, weights, params, grad_out):
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = fn(x, weights)
    grads = torch.autograd.grad(y, [x, weights, *params], grad_out)
    return [y.detach(), *grads]


def test_reference_matches_dense_and_torch_dispatcher():
    x, ids, weights, grad_out = make_problem(0)
    experts = make_experts()
    params = [experts.gate_up_proj, experts.down_proj]
    expected = forward_backward(lambda x, w: dense_reference(x, ids, w, *params), x, weights, params, grad_out)
    for dispatcher in (FusedDispatcher(backend="reference"), FusedDispatcher(backend="auto"), TorchDispatcher()):
        got = forward_backward(lambda x, w: dispatcher(x, ids, w, *params), x, weights, params, grad_out)
        for name, g, e in zip(("y", "dx", "dweights", "dgate_up", "ddown"), got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, msg=f"{type(dispatcher).__name__} {name}")
    assert expected[3][5].abs().max() == 0 and expected[4][5].abs().max() == 0  # the idle expert has no gradient


def _ep_rank(ep: int):
    """Per routing: relative errors of each dispatcher against the dense loop, and the fused op's sizes on this rank."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(ep)))
    local = E // ep
    mine = slice(rank * local, (rank + 1) * local)
    results = {}
    for kind in ROUTINGS:
        experts = make_experts()
        problems = [make_problem(r, kind) for r in range(ep)]
        full = [experts.gate_up_proj, experts.down_proj]
        # Dense reference on every rank's tokens, with the full expert stacks: expert grads sum over all ranks.
        xs = [p[0].clone().requires_grad_() for p in problems]
        ws = [p[2].clone().requires_grad_() for p in problems]
        ys = [dense_reference(xs[r], problems[r][1], ws[r], *full) for r in range(ep)]
        torch.autograd.backward(ys, [p[3] for p in problems])
        expected = [ys[rank].detach(), xs[rank].grad, ws[rank].grad, full[0].grad[mine], full[1].grad[mine]]
        x, ids, weights, grad_out = problems[rank]
        errors, saved = {}, set()
        for dispatcher in (
            FusedDispatcher(backend="reference").set_ep_group(group),
            TorchDispatcher().set_ep_group(group),
        ):
            experts = make_experts()
            keep_local_experts(experts, rank, ep)
            params = [experts.gate_up_proj, experts.down_proj]
            got = []
            shapes = saved_shapes(
                lambda: got.extend(
                    forward_backward(lambda x, w: dispatcher(x, ids, w, *params), x, weights, params, grad_out)
                )
            )
            if isinstance(dispatcher, FusedDispatcher):
                saved = shapes
                held = buffer_rows("reference", x, ids, weights, *(p.detach() for p in params), grad_out, E, group)
            errors[type(dispatcher).__name__] = [
                (g - e).abs().max().item() / (e.abs().max().item() + 1e-6) for g, e in zip(got, expected)
            ]
        received, rows = received_rows([p[1] for p in problems], rank, ep, 1, E)
        results[kind] = {
            "errors": errors,
            "received": received,
            "rows": rows,
            "saved": saved,
            "held": held,
            "local": local,
        }
    return results


def assert_sizes_follow_received_rows(kind: str, sizes: dict) -> None:
    """What autograd saved has the rows this rank receives (align 1: at least one), and nothing the op made held more
    rows than that or the T x K slots this rank sends."""
    rows, local = sizes["rows"], sizes["local"]
    assert rows == max(1, sizes["received"]), kind
    # (rows, 0): the received rows' scales, 0 wide at bf16
    allowed = {(rows, H), (rows, 0), (rows, 2 * I), (rows,), (T, K), (local,), (local, 2 * I, H), (local, H, I)}
    assert sizes["saved"] <= allowed, f"{kind}: saved {sizes['saved'] - allowed}"
    assert {(rows, H), (rows, 2 * I), (rows,)} <= sizes["saved"], kind
    assert sizes["held"] <= max(rows, T * K), f"{kind}: a tensor of {sizes['held']} rows, {rows} received, {T * K} sent"


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.slow
def test_reference_expert_parallel_gloo(ep):
    for rank, results in enumerate(run_world(ep, _ep_rank, ep)):
        for kind, result in results.items():
            for dispatcher, errors in result["errors"].items():
                assert max(errors) < 1e-5, f"rank {rank} {kind} {dispatcher}: relative errors {errors}"
            assert_sizes_follow_received_rows(f"rank {rank} {kind}", result)


def _tiny_model(ac):
    cfg = Qwen3MoeConfig.preset(
        "tiny", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, moe_intermediate_size=16
    )
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    dispatcher = FusedDispatcher(backend="reference")
    apply_expert_parallel(model, dispatcher, 0, 1)
    if ac is not None:
        ac.apply(
            model, saved_ops={"router": Router.saved_ops, "dispatcher": dispatcher.saved_ops}
        )  # as moe_lab.parallel.parallelize does
    return model


@pytest.mark.parametrize("ac", [FullCheckpoint, SelectiveCheckpoint])
@pytest.mark.slow
def test_block_compiles_fullgraph_under_ac(ac, monkeypatch):
    calls = count_forwards(monkeypatch)
    tokens = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(3))
    eager = _tiny_model(None)
    eager(tokens).logits.square().mean().backward()
    compiled = _tiny_model(ac())
    layer = compiled.model.layers[0]
    layer.forward = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")  # as apply_compile does
    calls.clear()
    compiled(tokens).logits.square().mean().backward()
    # Selective AC saves the op's outputs; full AC re-runs the op once in backward.
    assert len(calls) == (2 if ac is FullCheckpoint else 1)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_validate_rejects_gpu_backend_without_cuda():
    assert validation_error(FusedDispatcher(backend="gpu")) == "dispatcher.backend"
    assert validation_error(FusedDispatcher(backend="auto")) is None
    assert validation_error(FusedDispatcher(backend="gpu"), HOPPER, hidden=128, inter=128) is None
    if not torch.cuda.is_available():
        experts = make_experts()
        with pytest.raises(RuntimeError, match="needs CUDA"):
            FusedDispatcher(backend="gpu")(*make_problem(0)[:3], experts.gate_up_proj, experts.down_proj)


def test_validate_follows_its_target():
    """The same config against targets that differ in one fact: deep_gemm's import, the ranks per node, the GEMMs'
    multiple on a GPU (DeepGEMM's 128 at EP 1 where it imports, torch's 8 where it does not)."""
    absent = dataclasses.replace(HOPPER, deep_gemm_error="ImportError: no deep_gemm")
    assert validation_error(FusedDispatcher(gemm="deep_gemm"), absent) == "dispatcher.gemm"
    assert validation_error(FusedDispatcher(gemm="deep_gemm"), HOPPER, hidden=128, inter=128) is None
    assert validation_error(FusedDispatcher(), HOPPER) == "model.hidden_size"  # 64: not a multiple of 128
    assert validation_error(FusedDispatcher(), absent) is None  # torch._grouped_mm: 8 will do
    two_nodes = dataclasses.replace(HOPPER, world_size=4, ranks_per_node=2)
    assert validation_error(FusedDispatcher(), two_nodes, hidden=128, inter=128, ep=4) == "parallel.ep"
    assert validation_error(FusedDispatcher(backend="reference"), two_nodes, ep=4) is None


def test_layout_is_expert_contiguous_and_aligned():
    from moe_lab.moe.fused.layout import routing_layout

    _, ids, _, _ = make_problem(0)
    layout = routing_layout(ids, E, 16, None)
    pos, offs = layout.pos.reshape(-1), layout.offs.long()
    starts = torch.cat([offs.new_zeros(1), offs[:-1]])
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert pos.unique().numel() == pos.numel() and layout.rows == layout.max_rows == offs[-1]
    assert (starts % 16 == 0).all() and (offs - starts == (counts + 15) // 16 * 16).all()
    # Each slot lands inside its expert's segment, in (token, k) order within the expert.
    flat = ids.reshape(-1)
    assert ((pos >= starts[flat]) & (pos < starts[flat] + counts[flat])).all()
    for e in range(E):
        assert (pos[flat == e].diff() > 0).all()


@pytest.mark.parametrize("align", [1, 8, 128])
def test_layout_sizes_follow_received_rows_at_ep8(align):
    """Eight ranks' layouts from their counts, in one process: each rank's receive buffer has its received rows
    (padded per expert), every source's slots land inside their owner's buffer and expert segment without collision,
    and max_rows is the largest buffer, under every routing."""
    from moe_lab.moe.fused.layout import layout_from_counts

    ep, local = 8, E // 8
    for kind in ROUTINGS:
        all_ids = [routing(kind, r, T, E, K) for r in range(ep)]
        all_counts = torch.stack([torch.bincount(ids.reshape(-1), minlength=E) for ids in all_ids])
        layouts = [layout_from_counts(all_ids[r], all_counts, r, align) for r in range(ep)]
        expected = [received_rows(all_ids, r, ep, align, E) for r in range(ep)]
        assert [lay.rows for lay in layouts] == [rows for _, rows in expected], kind
        assert {lay.max_rows for lay in layouts} == {max(rows for _, rows in expected)}, kind
        for owner in range(ep):
            received, rows = expected[owner]
            assert rows <= max(align, 1.25 * received + local * (align - 1)), kind  # issue 15's bound
            offs = layouts[owner].offs.long()
            starts = torch.cat([offs.new_zeros(1), offs[:-1]])
            assert (starts % align == 0).all() and offs[-1] <= rows, kind
            landed = []
            for src in range(ep):
                ids, pos = all_ids[src].reshape(-1), layouts[src].pos.reshape(-1)
                to_owner = ids // local == owner
                expert = ids[to_owner] - owner * local
                landed.append(pos[to_owner])
                assert ((pos[to_owner] >= starts[expert]) & (pos[to_owner] < offs[expert])).all(), kind
            landed = torch.cat(landed)
            assert landed.numel() == received and landed.unique().numel() == received, kind


def test_fake_op_gives_the_residuals_one_unbacked_size():
    """Under the compiler (fake tensors), the residuals' rows are one data-dependent size (no bound but 0, as the
    torch dispatcher's all-to-all gives)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x, ids, weights = torch.empty(T, H), torch.zeros(T, K, dtype=torch.int64), torch.empty(T, K)
        local = E // 8  # the stacks of one of eight ranks
        stacks = torch.empty(local, 2 * I, H), torch.empty(local, H, I)
        y, x_routed, x_scales, gate_up, row_weight, row_src, pos, offs = torch.ops.moe_lab.fused_moe(
            x, ids, weights, *stacks, [], E, "", "gpu_deep_gemm", "rows", "bf16", "bf16"
        )
    rows = x_routed.shape[0]
    assert isinstance(rows, torch.SymInt)
    assert row_weight.shape == row_src.shape == (rows,) and gate_up.shape == (rows, 2 * I) and y.shape == (T, H)
    assert x_scales.shape == (rows, 0)
    assert pos.shape == (T, K) and offs.shape == (local,)
    assert rows.node.shape_env.var_to_range[rows.node.expr].lower == 0


def test_workspace_ladder_steps_are_at_most_a_quarter_apart():
    from moe_lab.moe.fused.layout import workspace_rows

    steps = sorted({workspace_rows(n) for n in range(1, 5000)})
    assert all(workspace_rows(n) >= n and workspace_rows(n) <= 1.25 * n for n in range(1, 5000))
    assert steps[:8] == list(range(1, 9)) and all(b <= 1.25 * a for a, b in zip(steps[7:], steps[8:]))
    assert workspace_rows(131072) == 131072 and workspace_rows(131073) == 163840
