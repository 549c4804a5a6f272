"""Routing statistics and router balancing (issue 19): every forward returns each layer's tokens per expert, summed
probabilities and entropy, also from blocks compiled with fullgraph=True under both AC modes; the statistics a
metrics row describes; the auxiliary loss trains every mesh shape alike; the expert bias evens the load by choice
alone, each layer's moved by that layer's load over every rank; with gradient accumulation the bias and the expert-load rows see the step's whole batch; and collecting the
statistics adds no host sync (GPU)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_lab import config
from moe_lab.job.trainer import train
from moe_lab.metrics.routing import ExpertLoad, describe
from moe_lab.models.qwen3_moe import Documents, Qwen3MoeConfig
from moe_lab.moe.dispatcher import FusedDispatcher
from moe_lab.moe.router import AuxLoss, ExpertBias, Router, routing_stats, split_stats
from moe_lab.parallel.ac import FullCheckpoint, SelectiveCheckpoint
from moe_lab.parallel.expert_parallel import apply_expert_parallel
from tests.distributed import run_world
from tests.test_offload import compose_train


def test_routing_stats_count_every_routing():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    ids = torch.tensor([[0, 1], [2, 0]])
    counts, prob_sums, entropy = split_stats(routing_stats(probs, ids))
    assert counts.tolist() == [2, 1, 1]
    torch.testing.assert_close(prob_sums, torch.tensor([0.8, 0.3, 0.9]))
    torch.testing.assert_close(entropy, -(probs * probs.log()).sum())


def test_describe_reads_balance_off_the_counts():
    counts = torch.tensor([[4.0, 4, 4, 4], [1, 2, 3, 10]])  # two layers, 4 experts, K=2: 8 tokens per layer
    stats = torch.cat([counts, torch.zeros(2, 4), torch.tensor([[8 * math.log(4)], [0.0]])], dim=1)
    row = describe(stats, top_k=2, ep=2)
    assert row["tokens"] == [[4, 4, 4, 4], [1, 2, 3, 10]]
    assert row["max_over_mean"] == [1.0, 2.5]
    assert row["busiest_ep_rank_share"] == [
        0.5,
        13 / 16,
    ]  # experts 2-3 on EP rank 1 (contiguous blocks, as EP holds them)
    assert row["entropy"] == pytest.approx([math.log(4), 0.0])


def test_expert_load_rows_come_at_the_interval_and_the_last_step():
    load = ExpertLoad(top_k=2, ep=1, every=3, steps=5)
    stats = torch.cat([torch.tensor([[3.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 1)], dim=1)
    rows = [load.add(step, stats, torch.tensor(0.5)) for step in range(5)]
    assert [i for i, row in enumerate(rows) if row] == [0, 3, 4]
    assert rows[3]["balance_loss"] == 0.5 and rows[3]["expert_load"]["tokens"] == [[3, 1]]
    summary = load.summary()
    assert summary["expert_load"]["tokens"] == [[15, 5]] and summary["expert_load_max_over_mean"] == 1.5


def tiny_model(ac=None, compiled=False, balance="aux_loss"):
    cfg = Qwen3MoeConfig.preset(
        "tiny",
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        moe_intermediate_size=16,
        router_balance=balance,
    )
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    model.init_buffers()
    dispatcher = FusedDispatcher(backend="reference")  # compiles in fp32 on the CPU (torch._grouped_mm: bf16 only)
    apply_expert_parallel(model, dispatcher, 0, 1)
    if ac is not None:
        ac.apply(model, saved_ops={"router": Router.saved_ops, "dispatcher": dispatcher.saved_ops})
    if compiled:
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, fullgraph=True, backend="aot_eager")
    return model


@pytest.mark.parametrize("ac", [None, FullCheckpoint, SelectiveCheckpoint], ids=["none", "full", "selective"])
def test_statistics_and_aux_loss_survive_compile_and_checkpointing(ac):
    """Blocks compiled with fullgraph=True (and wrapped by either AC mode) return the eager routing statistics, and
    the auxiliary loss's gradient reaches the routers as in eager, also with packed documents."""
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))
    documents = Documents(
        torch.tensor([[0] * 5 + [1] * 7, [0] * 12]).int(), torch.tensor([[*range(5), *range(7)], [*range(12)]])
    )
    runs = []
    for model in (tiny_model(), tiny_model(ac() if ac else None, compiled=True)):
        out = model(tokens, documents)
        balance = model.config.balance()
        (out.logits.square().mean() + balance.loss(out.router_stats)).backward()
        runs.append((out.router_stats.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_stats, eager_grads), (stats, grads) = runs
    torch.testing.assert_close(stats, eager_stats, rtol=1e-5, atol=1e-5)
    assert split_stats(stats)[0].sum(dim=-1).tolist() == [2 * 24] * 2
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _aux_loss_gradient(world_batch: torch.Tensor) -> dict:
    """This rank's share of the batch through the model, the auxiliary loss alone backward; the router gradient
    averaged over the ranks (as FSDP averages it)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model()
    share = world_batch.chunk(world)[rank]
    loss = model.config.balance().loss(model(share).router_stats)
    loss.backward()
    grads = [layer.mlp.gate.weight.grad.clone() for layer in model.model.layers]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world
    return {"grads": [g.numpy() for g in grads]}


def test_aux_loss_counts_the_global_batch():
    """The auxiliary loss's f_e counts the whole global batch, so two ranks' averaged router gradients are one
    rank's on the whole batch (transformers, counting each device alone, would differ)."""
    batch = torch.randint(0, 512, (4, 12), generator=torch.Generator().manual_seed(4))
    model = tiny_model()
    model.config.balance().loss(model(batch).router_stats).backward()
    two = run_world(2, _aux_loss_gradient, batch)
    for layer, expected in enumerate(model.model.layers):
        torch.testing.assert_close(
            torch.from_numpy(two[0]["grads"][layer]), expected.mlp.gate.weight.grad, rtol=1e-5, atol=1e-9
        )


def test_expert_bias_evens_the_load_by_choice_alone():
    """router_balance=bias: the bias moves toward the mean load each update and changes which experts are chosen,
    never their weights (the router's probabilities); the loss gets nothing."""
    router = Router(16, 8, 2, norm_topk_prob=False, balance="bias")
    with torch.no_grad():
        router.weight.normal_(generator=torch.Generator().manual_seed(0))
        router.weight[0] += 0.15  # expert 0 wins for most tokens
    router.init_buffers()
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(1)).abs()
    balance = ExpertBias(rate=0.01)
    imbalance = []
    model = torch.nn.Sequential(router)
    hottest = split_stats(router(x)[2])[0].argmax()
    for _ in range(60):
        ids, weights, stats = router(x)
        counts = split_stats(stats)[0]
        imbalance.append((counts.max() / counts.mean()).item())
        balance.update(model, stats.unsqueeze(0))
    assert balance.loss(stats.unsqueeze(0)) == 0.0
    assert max(imbalance[-10:]) < 0.7 * imbalance[0], imbalance  # sign steps then swing by about the rate
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    assert router.expert_bias[hottest] < 0 < router.expert_bias.max()


# Two ranks' tokens per expert of two layers (4 experts): each rank's own load, and each layer's, points the bias
# elsewhere than the global batch's does in every layer.
RANK_LOADS = [
    [[6.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 6.0]],
    [[0.0, 5.0, 2.0, 1.0], [1.0, 1.0, 5.0, 1.0]],
]


def _biases_after_one_update(rate: float) -> list[list[float]]:
    """Two bias-balanced routers (two layers) after one ExpertBias update from this rank's statistics."""
    import torch.distributed as dist

    routers = torch.nn.Sequential(*(Router(8, 4, 1, norm_topk_prob=False, balance="bias") for _ in range(2)))
    counts = torch.tensor(RANK_LOADS[dist.get_rank()])
    ExpertBias(rate).update(routers, torch.cat([counts, torch.zeros(2, 4), torch.zeros(2, 1)], dim=1))
    return [router.expert_bias.tolist() for router in routers]


def test_expert_bias_moves_each_layer_by_the_global_batchs_load():
    """Each layer's bias moves by rate * sign(mean load - load) of that layer's load summed over every rank, so
    the ranks' biases stay equal (layer 0: loads 6, 5, 3, 2 around a mean of 4; layer 1: 1, 2, 6, 7)."""
    expected = [[-0.1, -0.1, 0.1, 0.1], [0.1, 0.1, -0.1, -0.1]]
    for biases in run_world(2, _biases_after_one_update, 0.1):
        for layer, (bias, want) in enumerate(zip(biases, expected)):
            assert bias == pytest.approx(want), f"layer {layer}"


def _expert_load_rows(run_dir, *overrides) -> list[dict]:
    """The expert_load row of every step of a 3-step bias-balanced run (the bias rate high enough that each update
    changes which experts the next step chooses)."""
    cfg = compose_train(
        [
            "trainer.steps=3",
            "trainer.warmup_steps=0",
            "data.seq_len=16",
            "trainer.precision=fp32",
            "model.router_balance=bias",
            "model.router_bias_update_rate=0.05",
            "trainer.expert_load_every=1",
            *overrides,
        ]
    )
    train(cfg, config.validate(cfg), run_dir, torch.device("cpu"), 0, 1)
    return [json.loads(line)["expert_load"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_accumulated_micro_batches_move_the_bias_and_log_the_load_of_the_whole_step(tmp_path):
    """Batch 1 x accumulation 2 logs the load of one micro-batch of batch 2 (tokens per expert over both
    micro-batches), and moves the bias alike: the steps after the first route the same tokens to the same experts
    (a bias moved by the last micro-batch alone routes them otherwise)."""
    accumulated = _expert_load_rows(tmp_path / "accumulated", "trainer.grad_accum=2", "data.batch_size=1")
    whole = _expert_load_rows(tmp_path / "whole", "trainer.grad_accum=1", "data.batch_size=2")
    assert [row["tokens"] for row in accumulated] == [row["tokens"] for row in whole]
    assert sum(whole[0]["tokens"][0]) == 2 * 16 * 2  # batch 2 x 16 tokens, each routed to top-2
    for a, w in zip(accumulated, whole):
        assert a["entropy"] == pytest.approx(w["entropy"], rel=1e-5)


def test_aux_loss_value():
    """coef * E * sum_e f_e * P_e: two experts, K = 1, four tokens split evenly with mean probability 1/4 each."""
    stats = torch.cat(
        [torch.tensor([[2.0, 2.0]]), torch.tensor([[1.0, 1.0]]).requires_grad_(), torch.zeros(1, 1)], dim=1
    )
    loss = AuxLoss(coef=1.0, top_k=1).loss(stats)
    assert loss.item() == pytest.approx(2 * (0.5 * 0.25 + 0.5 * 0.25))  # E * sum f_e * P_e, 4 tokens


def test_aux_loss_value_with_two_experts_a_token():
    """K = 2 (where f_e counts each token's K routings over the tokens, as transformers' one-hot mean over [T, K, E]
    does): four experts, three tokens routed 3, 2, 1, 0 times, probability sums 1.2, 0.9, 0.6, 0.3: f = (1, 2/3,
    1/3, 0), P = (0.4, 0.3, 0.2, 0.1), loss = 4 * (0.4 + 0.2 + 0.2/3) = 8/3; its gradient by P's sums 4 * f / 3."""
    prob_sums = torch.tensor([[1.2, 0.9, 0.6, 0.3]], requires_grad=True)
    stats = torch.cat([torch.tensor([[3.0, 2.0, 1.0, 0.0]]), prob_sums, torch.zeros(1, 1)], dim=1)
    loss = AuxLoss(coef=1.0, top_k=2).loss(stats)
    assert loss.item() == pytest.approx(8 / 3)
    loss.backward()
    torch.testing.assert_close(prob_sums.grad, torch.tensor([[4 / 3, 8 / 9, 4 / 9, 0.0]]))


@pytest.mark.gpu
def test_collecting_statistics_adds_no_host_sync():
    """Routing, its statistics and ExpertLoad's bookkeeping between logging steps run without a host sync."""
    router = Router(64, 16, 4, norm_topk_prob=True).cuda()
    torch.nn.init.normal_(router.weight)
    load = ExpertLoad(top_k=4, ep=1, every=10, steps=100)
    x = torch.randn(4096, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 5):
            ids, weights, stats = router(x)
            assert load.add(step, torch.stack([stats, stats]), AuxLoss(0.001, 4).loss(torch.stack([stats]))) == {}
    finally:
        torch.cuda.set_sync_debug_mode("default")
