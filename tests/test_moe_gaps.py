"""Behaviour of the MoE layer's parts and the optimizers that the rest of the suite left unchecked (found by a
mutation audit): the router's fp32 softmax and the dtype of its weights, the auxiliary loss pooled over several
layers, SignSGD's update, the experts' compute dtype under autocast, and the fused reference op's row sources."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_lab.moe.router import AuxLoss, Router, routing_stats, split_stats
from moe_lab.optim.optimizers import SignSGD


def test_router_softmax_is_fp32_and_weights_come_back_in_the_input_dtype():
    """A bf16 router computes its softmax in fp32 (its probabilities and statistics are fp32 numbers, not bf16
    ones) and hands back the top-k weights in the input's dtype, the fp32 probabilities rounded once."""
    gen = torch.Generator().manual_seed(0)
    num_experts, top_k = 8, 2
    router = Router(32, num_experts, top_k, norm_topk_prob=False).to(torch.bfloat16)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, 32, generator=gen))
    x = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    ids, weights, stats = router(x)

    probs = torch.softmax(F.linear(x, router.weight).double(), dim=-1)  # the bf16 logits, softmax in float64
    assert weights.dtype == torch.bfloat16 and stats.dtype == torch.float32
    assert torch.equal(ids.sort(-1).values, probs.topk(top_k, dim=-1).indices.sort(-1).values)
    torch.testing.assert_close(weights, probs.gather(1, ids).to(torch.bfloat16), rtol=0, atol=0)
    _, prob_sums, entropy = split_stats(stats)
    torch.testing.assert_close(prob_sums.double(), probs.sum(0), rtol=1e-5, atol=1e-5)  # bf16 probs: ~1e-3 off
    torch.testing.assert_close(entropy.double(), -(probs * probs.log()).sum(), rtol=1e-5, atol=1e-5)


def test_aux_loss_pools_every_layer_as_transformers_does():
    """With several layers the auxiliary loss is transformers' ``load_balancing_loss_func`` over the layers' routings
    concatenated: f_e and P_e count the routings and probabilities of every layer (not one layer's), times E."""
    gen = torch.Generator().manual_seed(1)
    layers, tokens, num_experts, top_k, coef = 3, 10, 4, 2, 0.5
    logits = torch.randn(layers, tokens, num_experts, generator=gen) * torch.tensor([0.5, 2.0, 4.0])[:, None, None]
    probs = torch.softmax(logits, dim=-1)
    ids = probs.topk(top_k, dim=-1).indices
    stats = torch.stack([routing_stats(probs[layer], ids[layer]) for layer in range(layers)])

    # transformers: one-hot [L*T, K, E] averaged over the tokens, summed over k; mean probability over L*T tokens
    mask = F.one_hot(ids.reshape(-1, top_k), num_experts).float()
    expected = coef * num_experts * (mask.mean(0) * probs.reshape(-1, num_experts).mean(0)).sum()
    torch.testing.assert_close(AuxLoss(coef, top_k).loss(stats), expected)


def test_signsgd_step_is_sign_descent_with_decoupled_weight_decay():
    """SignSGD: p <- p * (1 - lr * wd) - lr * sign(g) for every parameter with a gradient (sign(0) = 0), a
    parameter without a gradient untouched (no weight decay either)."""
    gen = torch.Generator().manual_seed(2)
    lr, wd = 0.1, 0.5
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=gen)) for _ in range(3)]
    params[0].grad = torch.randn(3, 4, generator=gen)
    params[1].grad = torch.randn(3, 4, generator=gen) * (torch.rand(3, 4, generator=gen) > 0.5)  # zeros in it
    before = [p.detach().clone() for p in params]
    optimizer = SignSGD([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=lr, weight_decay=wd)
    optimizer.step()
    for p, p0 in zip(params[:2], before[:2]):
        torch.testing.assert_close(p.detach(), p0 * (1 - lr * wd) - lr * torch.sign(p.grad))
    assert torch.equal(params[2].detach(), before[2])  # no gradient: not stepped
    params[2].grad = torch.full((3, 4), -3.0)
    optimizer.step()  # its group has no weight decay: a pure sign step
    torch.testing.assert_close(params[2].detach(), before[2] + lr)


def _received_rows(kinds: tuple[str, ...]) -> dict:
    """Per routing kind, this rank's fused reference op at EP=2 (tests/test_fused_reference.py's problem): what it
    received, where its own slots went."""
    import torch.distributed as dist

    from moe_lab.parallel.expert_parallel import keep_local_experts
    from tests.fused_cases import bf16_op
    from tests.test_fused_reference import E, make_experts, make_problem

    rank = dist.get_rank()
    experts = make_experts()
    keep_local_experts(experts, rank, dist.get_world_size())
    stacks = (experts.gate_up_proj.detach(), experts.down_proj.detach())
    out = {}
    for kind in kinds:
        x, ids, weights, _ = make_problem(rank, kind)
        _, rows, _, _, weight, src, pos, _ = bf16_op(
            x, ids, weights, *stacks, E, dist.group.WORLD.group_name, "reference"
        )
        out[kind] = {"rows": rows.numpy(), "row_weight": weight.numpy(), "row_src": src.numpy(), "pos": pos.numpy()}
    return out


def test_reference_op_records_each_received_rows_source_token_and_weight_at_ep2():
    """The fused reference op's residuals at EP=2 (gloo): received row pos[t, k] on the owner of slot (t, k) holds
    x[t] of the sending rank, its routing weight, and as its source ``rank * T + t``; a rank that receives nothing
    (half-idle routing) holds one padding row with source -1 (what the gpu backend's shortcuts read)."""
    from tests.distributed import run_world
    from tests.test_fused_reference import E, T, make_problem

    ep, local, kinds = 2, E // 2, ("zipf", "half_idle")
    by_rank = run_world(ep, _received_rows, kinds)
    for kind in kinds:
        got = [results[kind] for results in by_rank]
        expected = [{"rows": {}, "row_weight": {}, "row_src": {}} for _ in range(ep)]
        for src in range(ep):
            x, ids, weights, _ = make_problem(src, kind)
            for (t, k), e in zip(torch.cartesian_prod(torch.arange(T), torch.arange(ids.shape[1])), ids.flatten()):
                owner, row = int(e) // local, int(got[src]["pos"][t, k])
                expected[owner]["rows"][row] = x[t]
                expected[owner]["row_weight"][row] = weights[t, k]
                expected[owner]["row_src"][row] = src * T + int(t)
        for owner in range(ep):
            mine, want = got[owner], expected[owner]
            received = sorted(want["row_src"])
            assert received == list(range(len(received))), f"{kind}: rank {owner} rows {received}"
            if not received:
                assert mine["row_src"].tolist() == [-1], f"{kind}: rank {owner}'s padding"
                continue
            assert mine["row_src"].tolist() == [want["row_src"][r] for r in received], f"{kind}: rank {owner}"
            rows = torch.from_numpy(mine["rows"])
            assert torch.equal(rows, torch.stack([want["rows"][r] for r in received])), f"{kind}: rank {owner}"
            row_weight = torch.from_numpy(mine["row_weight"])
            assert torch.equal(row_weight, torch.stack([want["row_weight"][r] for r in received])), kind


def test_experts_and_fused_dispatcher_compute_in_the_autocast_dtype():
    """Under bf16 autocast the fp32 experts compute in bf16 (``compute_dtype``): GroupedExperts gives the bf16
    per-expert loop's output, in bf16, and the fused dispatcher casts x and the routing weights to bf16 and returns
    y in bf16, its gradients those of fp32 parameters within bf16's error (backward runs outside autocast, the
    stacks cast to the compute dtype before the op)."""
    from moe_lab.moe.dispatcher import FusedDispatcher
    from moe_lab.moe.experts import GroupedExperts
    from tests.test_fused_reference import dense_reference, forward_backward, make_experts, make_problem

    gen = torch.Generator().manual_seed(3)
    experts = GroupedExperts(4, 16, 16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3, generator=gen)
        experts.down_proj.normal_(0, 0.3, generator=gen)
    tokens_per_expert, rows = torch.tensor([3, 0, 5, 2]), torch.randn(10, 16, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(rows, tokens_per_expert)
    bf16 = [t.detach().to(torch.bfloat16) for t in (rows, experts.gate_up_proj, experts.down_proj)]
    expected = []
    for e, segment in enumerate(bf16[0].split(tokens_per_expert.tolist())):
        gate, up = (segment @ bf16[1][e].T).chunk(2, dim=-1)
        expected.append((F.silu(gate) * up) @ bf16[2][e].T)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, torch.cat(expected))

    x, ids, weights, grad_out = make_problem(0)
    experts = make_experts()
    params = [experts.gate_up_proj, experts.down_proj]
    x_in = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = FusedDispatcher(backend="reference")(x_in, ids, weights, *params)
    y.backward(grad_out.to(y.dtype))  # backward outside autocast, as a training step runs it
    assert y.dtype == torch.bfloat16 and x_in.grad.dtype == params[0].grad.dtype == torch.float32
    expected = forward_backward(
        lambda x, w: dense_reference(x, ids, w, *params), x, weights, params, grad_out
    )  # fp32, every operand exact
    for name, got, want in zip(
        ("y", "dx", "dgate_up", "ddown"), (y, x_in.grad, *(p.grad for p in params)), expected[:2] + expected[3:]
    ):
        error = (got.double() - want.double()).norm() / want.double().norm()
        assert error < 0.02, f"{name}: relative error {error:.4f}"  # bf16 rounding: ~0.5 %


def test_fp8_experts_default_weight_gradient_is_the_exact_product_of_the_kept_operands():
    """At expert_precision fp8 with wgrad_precision bf16 (the default) the down projection's weight gradient is the
    unquantized product dy^T @ (silu(gate) * up * w) of each expert's rows, gate/up as forward kept it: only
    wgrad_precision fp8 quantizes the weight gradients' operands."""
    from moe_lab.moe.fused.ops import expert_weights
    from tests.test_fp8 import E, problem, run_op

    x, ids, w, gate_up_proj, down_proj, grad_out = problem(tokens=24)
    _, _, _, gate_up, row_weight, row_src, _, offs = torch.ops.moe_lab.fused_moe(
        x, ids, w, gate_up_proj, down_proj, expert_weights("fp8", gate_up_proj, down_proj), E, "", "reference", "rows",
        "fp8", "bf16",
    )  # fmt: skip
    expected = torch.zeros_like(down_proj)
    for j, (start, end) in enumerate(zip([0, *offs.tolist()], offs.tolist())):
        gate, up = gate_up[start:end].chunk(2, dim=-1)
        expected[j] = grad_out[row_src[start:end]].T @ (F.silu(gate) * up * row_weight[start:end, None])
    d_down_proj = run_op("fp8", "reference", x, ids, w, gate_up_proj, down_proj, grad_out)[4]
    torch.testing.assert_close(d_down_proj, expected, rtol=1e-5, atol=1e-6)
