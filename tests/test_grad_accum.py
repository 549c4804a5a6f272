"""Gradient accumulation (issue 18): batch B x accumulation A trains like batch A*B in one step.

For every offload mode, at world 1 and at world 2 (FSDP2 + EP 2, gloo), the training loop's own micro-batch step
(``moe_lab.job.trainer.accumulate_gradients`` with the loop's FSDP2 and offload calls) is compared with an independent
reference: the unparallelised model and plain torch AdamW (for-loop kernel) on the step's whole batch in one
backward. Per step: the loss, and the gradient each optimizer steps with (read by a step pre-hook on the torch
optimizers it is made of: the model's, offload=optimizer's chunk optimizers' shards, offload=full's host step's
transfer buffer);
after the steps, the weights. AdamW's eps is raised to 1 so that its update follows the gradient's scale (with the
default eps a missing 1/A would hardly move the weights). A real ``python -m moe_lab.train`` job at world 2 x
accumulation 2 checks the loop end to end, with its tokens per step.

Tolerances: fp32 throughout; only the summation order differs (micro-batches, ranks, the fused / for-loop kernels).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate

from moe_lab import config
from moe_lab.data.synthetic import SyntheticData
from moe_lab.job.trainer import accumulate_gradients, build_model
from moe_lab.optim.offload import FullOffload
from moe_lab.optim.offload.full import InBackwardOptimizer
from moe_lab.optim.offload.optimizer import StreamedStateOptimizer
from moe_lab.parallel import set_micro_batch
from moe_lab.parallel.sharding import local_rows, local_shard
from tests.cli import train_cli
from tests.distributed import run_world
from tests.test_offload import SMALL_CHUNKS, compose_train

STEPS = 3
GLOBAL_BATCH = 4  # samples per optimizer step, over all ranks and micro-batches
SEQ = 16
# Constant LR (warmup 0, no decay), so the reference needs no scheduler; eps 1: the update scales with the gradient.
# No balance loss: the reference trains the language-model loss alone (tests/test_routing.py covers the aux loss).
COMMON = [
    "trainer.steps=3",
    "trainer.warmup_steps=0",
    "trainer.min_lr_ratio=1.0",
    "optimizer.eps=1.0",
    "optimizer.lr=0.01",
    f"data.seq_len={SEQ}",
    "trainer.device=cpu",
    "trainer.precision=fp32",
    "model.router_balance=none",
]


def reference(cfg) -> dict:
    """Losses, per-step gradients (by parameter name) and final weights of the plain model trained by plain AdamW
    on each step's whole global batch."""
    model = instantiate(cfg.model).build()
    model.init_weights(cfg.trainer.seed)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    o = cfg.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, foreach=False
    )
    data = SyntheticData(SEQ, GLOBAL_BATCH, cfg.model.vocab_size, seed=cfg.data.seed)
    losses, grads = [], []
    for step in range(STEPS):
        batch = data.batch(step, 0, 1)
        loss = F.cross_entropy(model(batch.inputs).logits.flatten(0, 1), batch.labels.flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "weights": weights, "initial": initial}


def stepped_gradients(optimizer: torch.optim.Optimizer, names: dict) -> list[dict]:
    """A list that gets, at each step, the gradient (this rank's part, flat) each model parameter is stepped with,
    by name, read by step pre-hooks on the torch optimizers doing the stepping (a parameter that offload=optimizer
    steps in pieces: its pieces, in order, joined)."""
    seen: list[dict] = []
    total = sum(local_shard(p).numel() for p in names)

    def record(pieces):  # pieces: () -> [(name, grad)]
        if not seen or sum(g.numel() for g in seen[-1].values()) == total:
            seen.append({})
        for name, grad in pieces():
            grad = grad.detach().clone().reshape(-1)
            seen[-1][name] = torch.cat([seen[-1][name], grad]) if name in seen[-1] else grad

    if isinstance(optimizer, InBackwardOptimizer):
        for chunk in optimizer.chunks:  # the chunk's host step reads the gradients in the transfer buffer

            def pieces(transfer, chunk=chunk):
                return [
                    (names[p], transfer[offset : offset + size].float()) for p, (offset, size) in chunk.offsets.items()
                ]

            chunk.optimizer.register_step_pre_hook(lambda o, a, k, pieces=pieces: record(lambda: pieces(k["transfer"])))
    elif isinstance(optimizer, StreamedStateOptimizer):
        for chunk in optimizer.chunks:

            def pieces(chunk=chunk):
                return [(names[p], s.grad) for p, s in zip(chunk.params, chunk.shards)]

            chunk.optimizer.register_step_pre_hook(lambda o, a, k, pieces=pieces: record(pieces))
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.register_step_pre_hook(
            lambda o, a, k: record(lambda: [(names[p], local_shard(p.grad)) for p in params])
        )
    return seen


def accumulated_run(overrides: list[str]) -> dict:
    """This rank's losses, stepped gradients and final weights (fp32 masters under offload=full), as the training
    loop computes them, each weight and gradient with the index of its first row in the whole parameter."""
    cfg = compose_train(COMMON + overrides)
    options = config.validate(cfg)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = build_model(cfg, options, torch.device("cpu"), torch.float32)
    rows = local_rows(model)
    names = {p: name for name, p in model.named_parameters()}
    optimizer = options.offload.build(model, options.make_optimizer, torch.float32)
    grads = stepped_gradients(optimizer, names)

    def load(step, micro_batch):
        return options.data.batch(step, rank, world, micro_batch, cfg.trainer.grad_accum)

    def micro_batch_loss(batch):
        out = model(batch.inputs, batch.documents, labels=batch.labels, loss=options.loss)  # as the trainer calls it
        return out.loss, out.router_stats

    def before_micro_batch(final):  # what moe_lab.job.trainer.train does
        set_micro_batch(model, final, cfg.parallel.grad_sync, cfg.parallel.reshard_after_forward)
        options.offload.before_micro_batch(optimizer, final)

    losses = []
    for step in range(STEPS):
        loss, _, _ = accumulate_gradients(
            functools.partial(load, step),
            micro_batch_loss,
            options.model.balance().loss,
            cfg.trainer.grad_accum,
            before_micro_batch,
        )
        optimizer.step()
        optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss.item() / world)
    weights = (
        optimizer.master_weights()
        if isinstance(optimizer, InBackwardOptimizer)
        else [local_shard(p).detach() for p in model.parameters()]
    )
    return {
        "losses": losses,
        "grads": grads,
        "weights": {name: w.reshape(-1).clone() for (name, _), w in zip(model.named_parameters(), weights)},
        "first_row": {name: first for name, (_, first) in rows.items()},
        "shape": {name: tuple(t.shape) for name, (t, _) in rows.items()},
    }


def max_differences(overrides: list[str]) -> dict:
    """Largest differences of an accumulated run from the reference (on this rank's parts), relative to the
    largest reference value of each kind."""
    run = accumulated_run(overrides)
    ref = reference(compose_train(COMMON + overrides))

    def part(name, tensor):  # this rank's rows of a whole reference tensor, flat
        first, shape = run["first_row"][name], run["shape"][name]
        return tensor[first : first + shape[0]].reshape(-1)

    assert len(run["grads"]) == STEPS and all(set(g) == set(ref["weights"]) for g in run["grads"])
    grad = max(
        (run["grads"][s][n] - part(n, g)).abs().max().item() for s in range(STEPS) for n, g in ref["grads"][s].items()
    )
    grad_scale = max(g.abs().max().item() for s in range(STEPS) for g in ref["grads"][s].values())
    moved = max((part(n, w) - part(n, ref["initial"][n])).abs().max().item() for n, w in ref["weights"].items())
    weight = max((run["weights"][n] - part(n, w)).abs().max().item() for n, w in ref["weights"].items())
    loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
    return {"loss": loss, "grad": grad / grad_scale, "weight": weight, "moved": moved}


def check(differences: dict) -> None:
    assert differences["loss"] <= 1e-5, differences
    assert differences["grad"] <= 1e-5, differences
    # The steps move the weights by up to 3e-3; a gradient off by the factor 2 of the accumulation moves them 1e-3 more.
    assert differences["moved"] > 1e-3, differences
    assert differences["weight"] <= 1e-6, differences


MODES = {"none": [], "optimizer": SMALL_CHUNKS, "full": SMALL_CHUNKS + ["offload.numa_bind=false"]}


@pytest.mark.parametrize("mode", list(MODES))
def test_accumulation_matches_one_big_batch_world1(mode):
    check(
        max_differences(
            [f"offload={mode}", *MODES[mode], "trainer.grad_accum=2", f"data.batch_size={GLOBAL_BATCH // 2}"]
        )
    )


@pytest.mark.parametrize(
    "variant", [["ac=full"], ["ac=selective"], ["dispatcher=fused"], ["dispatcher=fused", "ac=selective"]]
)
def test_accumulation_under_checkpointing_and_dispatchers(variant):
    full = ["offload=full", *MODES["full"]]  # the mode whose hooks must wait for the last micro-batch
    check(max_differences([*variant, *full, "trainer.grad_accum=2", f"data.batch_size={GLOBAL_BATCH // 2}"]))


def test_one_micro_batch_matches_the_reference_too():
    """The reference is right about the plain path: one micro-batch of the whole batch."""
    check(max_differences(["trainer.grad_accum=1", f"data.batch_size={GLOBAL_BATCH}"]))


WORLD2 = {  # name: overrides on 2 ranks (EP 2), batch 1 x accumulation 2
    "none": ["offload=none"],
    "optimizer": ["offload=optimizer", *SMALL_CHUNKS],
    "full": ["offload=full", *MODES["full"]],
    "none_reduce_each_micro_batch": ["offload=none", "parallel.grad_sync=micro_batch"],
    "full_kept_gathered": ["offload=full", *MODES["full"], "parallel.reshard_after_forward=false"],
    "full_reduce_each_kept_gathered": [
        "offload=full",
        *MODES["full"],
        "parallel.grad_sync=micro_batch",
        "parallel.reshard_after_forward=false",
    ],
}


def _world2_differences() -> dict:
    mesh = ["trainer.nproc_per_node=2", "parallel.ep=2", "trainer.grad_accum=2", f"data.batch_size={GLOBAL_BATCH // 4}"]
    return {name: max_differences(mesh + overrides) for name, overrides in WORLD2.items()}


@pytest.mark.slow
def test_accumulation_matches_one_big_batch_world2_fsdp_ep2(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for rank_differences in run_world(2, _world2_differences):
        for name, differences in rank_differences.items():
            check(differences | {"run": name})


def _collectives_per_step() -> dict:
    """FSDP2's all-gathers and reduce-scatters in one step of two micro-batches, per (grad_sync,
    reshard_after_forward)."""
    counts = {}
    for sync, reshard in [("step", True), ("micro_batch", True), ("step", False)]:
        cfg = compose_train(
            COMMON
            + [
                "trainer.nproc_per_node=2",
                "parallel.ep=2",
                "data.batch_size=1",
                f"parallel.grad_sync={sync}",
                f"parallel.reshard_after_forward={str(reshard).lower()}",
            ]
        )
        options = config.validate(cfg)
        model = build_model(cfg, options, torch.device("cpu"), torch.float32)

        def load(micro_batch):
            return options.data.batch(0, dist.get_rank(), 2, micro_batch, 2)

        def micro_batch_loss(batch):
            out = model(batch.inputs, batch.documents, labels=batch.labels, loss=options.loss)
            return out.loss, out.router_stats

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            accumulate_gradients(
                load,
                micro_batch_loss,
                options.model.balance().loss,
                2,
                lambda final: set_micro_batch(model, final, sync, reshard),
            )
        names = [e.name for e in prof.events()]
        counts[f"{sync}, reshard_after_forward={reshard}"] = (
            names.count("c10d::_allgather_base_"),
            names.count("c10d::_reduce_scatter_base_"),
        )
    return counts


@pytest.mark.slow
def test_fsdp_reduces_once_per_step_and_keeps_blocks_gathered(monkeypatch):
    """The tiny model at world 2, EP 2 has four FSDP2 groups over both ranks (embedding, two blocks, norm + head;
    the experts' shard group is one rank: no collective). Per micro-batch, forward gathers all four and backward
    the three that resharded after forward (not the head); reshard_after_forward=false gathers each once per
    step. grad_sync=step reduce-scatters each group once per step, micro_batch once per micro-batch."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    groups, micro_batches = 4, 2
    counts = run_world(2, _collectives_per_step)[0]  # (all-gathers, reduce-scatters)
    assert counts == {
        "step, reshard_after_forward=True": (micro_batches * (2 * groups - 1), groups),
        "micro_batch, reshard_after_forward=True": (micro_batches * (2 * groups - 1), micro_batches * groups),
        "step, reshard_after_forward=False": (groups, groups),
    }


def test_training_job_counts_every_micro_batch(tmp_path):
    """``python -m moe_lab.train`` at world 2 x accumulation 2 (offload=full) against world 1 in one micro-batch:
    the same losses, held-out losses on the same samples, and tokens per step (and so tokens/s) counting both
    micro-batches."""
    root = Path(__file__).resolve().parents[1]

    def job(name, *overrides):
        run_dir = tmp_path / name
        proc = train_cli(
            f"hydra.run.dir={run_dir}", *COMMON, "trainer.eval_every=2", *overrides, cwd=root
        )  # forked: tests/cli.py
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return json.loads((run_dir / "result.json").read_text())["metrics"]

    accumulated = job(
        "accum",
        "trainer.nproc_per_node=2",
        "parallel.ep=2",
        "trainer.grad_accum=2",
        "data.batch_size=1",
        "offload=full",
        "offload.numa_bind=false",
    )
    one = job("one", f"data.batch_size={GLOBAL_BATCH}")
    assert accumulated["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert [e["step"] for e in accumulated["eval_losses"]] == [e["step"] for e in one["eval_losses"]] == [1, 2]
    evaluated = [e["loss"] for e in accumulated["eval_losses"]]
    assert evaluated == pytest.approx([e["loss"] for e in one["eval_losses"]], rel=1e-5)
    assert (
        accumulated["tokens_per_step_per_gpu"] == 2 * 1 * SEQ and one["tokens_per_step_per_gpu"] == GLOBAL_BATCH * SEQ
    )
    assert accumulated["tokens_per_s_per_gpu"] == pytest.approx(2 * SEQ / accumulated["s_per_step"])


def test_full_offload_takes_gradients_the_last_micro_batch_did_not_reach():
    """A parameter used by an earlier micro-batch only keeps its accumulated gradient on the device (its hook does
    not fire in the last backward): step() takes it to the host and steps it, as plain AdamW steps the sum."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    offload = FullOffload(chunk_mib=64 * 4 / 2**20, numa_bind=False)  # a chunk per weight or bias
    make_optimizer = functools.partial(torch.optim.AdamW, lr=0.01, eps=1.0)
    optimizer = offload.build(model, make_optimizer, torch.float32)
    inputs = torch.randn(2, 4, 8)

    def micro_batch_loss(net, micro_batch):  # the second micro-batch stops after the first layer
        out = net(inputs[micro_batch]) if micro_batch == 0 else net[0](inputs[micro_batch])
        return out.square().mean()

    def forward(micro_batch):
        return micro_batch_loss(model, micro_batch), torch.zeros(0)  # no router: no routing statistics

    accumulate_gradients(
        lambda micro_batch: micro_batch,
        forward,
        lambda stats: 0.0,
        2,
        lambda final: offload.before_micro_batch(optimizer, final),
    )
    optimizer.step()
    plain = make_optimizer(reference.parameters())
    (sum(micro_batch_loss(reference, j) for j in range(2)) / 2).backward()
    plain.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), atol=1e-6, rtol=0)


def test_every_micro_batch_is_loaded_before_the_first_begins():
    """The offload optimizer's state loads start in the first ``before_micro_batch``: each batch's copy to the
    device is issued before them, since a copy waits for every one in its direction issued before it."""
    events = []

    def load(micro_batch):
        events.append(f"load {micro_batch}")
        return torch.tensor(float(micro_batch + 1), requires_grad=True)

    def forward(batch):
        events.append(f"forward {int(batch.item()) - 1}")
        return batch * 2.0, torch.zeros(0)

    loss, _, _ = accumulate_gradients(
        load, forward, lambda stats: 0.0, 3, lambda final: events.append(f"before {final}")
    )
    assert events == [
        "load 0",
        "load 1",
        "load 2",
        "before False",
        "forward 0",
        "before False",
        "forward 1",
        "before True",
        "forward 2",
    ]
    assert loss.item() == pytest.approx(2 * (1 + 2 + 3) / 3)


def test_balance_loss_is_averaged_over_micro_batches_too():
    """The routing balance term is part of each micro-batch's objective: scaled by 1 / micro-batches as the
    language-model loss is, in the gradients and in the returned balance (the end-to-end tests above train with
    ``router_balance=none`` or the bias, whose loss is 0). Micro-batch m: lm loss 0, routing statistics
    ``p * (m + 1)``, balance ``sum(stats)``: the step's mean balance is 3 * (1 + 2) / 2 = 4.5, d/dp = (1 + 2) / 2."""
    p = torch.ones(3, requires_grad=True)
    loss, balance, stats = accumulate_gradients(
        lambda micro_batch: micro_batch,
        lambda micro_batch: (p.sum() * 0, p * (micro_batch + 1)),
        lambda stats: stats.sum(),
        2,
        lambda final: None,
    )
    assert loss.item() == 0
    assert balance.item() == pytest.approx(4.5)
    torch.testing.assert_close(p.grad, torch.full((3,), 1.5))
    torch.testing.assert_close(stats, torch.full((3,), 3.0))  # summed over the micro-batches, not averaged


@pytest.mark.parametrize(
    "overrides, key",
    [(["trainer.grad_accum=0"], "trainer.grad_accum"), (["parallel.grad_sync=never"], "parallel.grad_sync")],
)
def test_accumulation_rules_fail_with_their_key(overrides, key):
    with pytest.raises(config.ConfigError) as e:
        config.validate(compose_train(overrides))
    assert e.value.key == key
