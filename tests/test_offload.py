"""Offload modes (issue 4): after a few steps on the tiny model, offload=optimizer and offload=full leave the same
parameters as offload=none (plain torch AdamW / SignSGD), at world 1 and at world 2 (FSDP2 + EP 2, gloo), every mode
with its LR driven by moe_lab.optim.schedule.warmup_cosine; each offload optimizer is a torch.optim.Optimizer whose
chunk optimizers step with the scheduled LR and, on a small model, match plain AdamW with the LR set by hand (issue
14); each config rule fails with its key; a stuck CPU worker raises instead of hanging.

Tolerances: with fp32 compute (the CPU default) every mode computes the same gradients, so parameters agree to
float32 rounding (full offload steps with torch's fused CPU AdamW kernel, none with the for-loop one): atol 1e-6.
With bf16 compute, full offload keeps bf16 weights on the device and rounds gradients to bf16; its reference is a
plain loop written here (fp32 masters stepped by torch AdamW / SignSGD with the bf16 model's gradients, widened).
The fp32 masters agree to atol 1e-6 (4e-9 seen), while that reference is 4e-3 away from an fp32-compute run.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch import nn

from moe_lab import config
from moe_lab.config import ConfigError
from moe_lab.job.trainer import build_model, train
from moe_lab.optim.offload import FullOffload, NoOffload, OptimizerOffload, host_kernel, numa
from moe_lab.optim.offload.chunked import ChunkedOptimizer
from moe_lab.optim.offload.full import InBackwardOptimizer, device_chunk_count
from moe_lab.optim.offload.host import SideStream, check_host_memory
from moe_lab.optim.offload.host_step import (
    HOST_STEP_SWITCH_INTERVAL_S,
    HOST_STEPS,
    HostSignSGD,
    host_optimizer,
    prompt_gil_handover,
)
from moe_lab.optim.offload.optimizer import StreamedStateOptimizer
from moe_lab.optim.optimizers import SignSGD
from moe_lab.optim.schedule import warmup_cosine
from moe_lab.parallel.sharding import local_shard
from moe_lab.plan.config import compose as compose_plan
from moe_lab.plan.planner import plan
from moe_lab.runtime import device as runtime_device
from tests import configs
from tests.distributed import run_world
from tests.test_schedule import expected_factor

STEPS = 4
# Several chunks and fewer transfer buffers than chunks, so chunking and buffer reuse are exercised.
SMALL_CHUNKS = ["offload.chunk_mib=0.05", "offload.max_inflight=2"]


def compose_train(overrides: list[str]):
    return configs.compose_train(*overrides)


def run_steps(overrides: list[str], steps: int = STEPS, device: str = "cpu") -> list[torch.Tensor]:
    """Build the model as moe_lab.train does, run ``steps`` steps, return this rank's fp32 weights (the host
    masters under full offload)."""
    cfg = compose_train([f"trainer.steps={STEPS}"] + overrides)
    options = config.validate(cfg)
    device = torch.device(device)
    bf16 = cfg.trainer.precision == "bf16" or (cfg.trainer.precision == "auto" and device.type == "cuda")
    compute_dtype = torch.bfloat16 if bf16 else torch.float32
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    model = build_model(cfg, options, device, compute_dtype)
    optimizer = options.offload.build(model, options.make_optimizer, compute_dtype)
    scheduler = schedule(optimizer, cfg)
    data = instantiate(cfg.data)
    for step in range(steps):
        batch = data.batch(
            step, rank, torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        ).to(device)
        inputs, labels = batch.inputs, batch.labels
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs).logits
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if isinstance(optimizer, InBackwardOptimizer):
        return [w.cpu().clone() for w in optimizer.master_weights()]
    return [local_shard(p).detach().float().cpu() for p in model.parameters()]


def schedule(optimizer: torch.optim.Optimizer, cfg):
    return warmup_cosine(optimizer, cfg.trainer.steps, cfg.trainer.warmup_steps, cfg.trainer.min_lr_ratio)


def scheduled_lrs(cfg, steps: int = STEPS) -> list[float]:
    """The LR of each step under ``cfg``'s schedule, read off a throwaway optimizer."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    scheduler = schedule(optimizer, cfg)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def reference_bf16_masters(overrides: list[str], steps: int = STEPS, device: str = "cpu") -> list[torch.Tensor]:
    """fp32 masters stepped by plain torch AdamW with the gradients of a bf16 copy of the model."""
    cfg = compose_train([f"trainer.steps={STEPS}"] + overrides)
    with torch.device("meta"):
        model = instantiate(cfg.model).build()
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights()
    masters = [p.detach().clone().requires_grad_() for p in model.parameters()]
    optimizer = instantiate(cfg.optimizer)(masters)
    scheduler = schedule(optimizer, cfg)
    model.to(torch.bfloat16)
    data = instantiate(cfg.data)
    for step in range(steps):
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m)
        batch = data.batch(step, 0, 1).to(device)
        inputs, labels = batch.inputs, batch.labels
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            logits = model(inputs).logits
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
        for p, m in zip(model.parameters(), masters):
            m.grad = p.grad.float()
            p.grad = None
        optimizer.step()
        scheduler.step()
    return [m.detach().cpu() for m in masters]


def assert_all_close(actual, expected, atol):
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a, e, atol=atol, rtol=0, msg=lambda m: f"parameter {i}: {m}")


@pytest.mark.parametrize("optimizer", ["adamw", "signsgd"])
def test_offload_modes_match_none(optimizer):
    reference = run_steps([f"optimizer={optimizer}", "offload=none"])
    initial = run_steps([f"optimizer={optimizer}", "offload=none"], steps=0)
    assert any(not torch.equal(r, i) for r, i in zip(reference, initial))  # the steps moved the weights
    for mode in ("optimizer", "full", "full offload.device_share=0.5"):
        assert_all_close(
            run_steps([f"optimizer={optimizer}", *f"offload={mode}".split()] + SMALL_CHUNKS), reference, atol=1e-6
        )


@pytest.mark.parametrize("device_share", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("optimizer", ["adamw", "signsgd"])
def test_full_offload_bf16_matches_bf16_gradient_reference(optimizer, device_share):
    """bf16 weights stepped through fp32 masters, on the host, partly on the device, or all on the device."""
    overrides = [f"optimizer={optimizer}", "trainer.precision=bf16"]
    expected = reference_bf16_masters(overrides)
    assert_all_close(
        run_steps(overrides + ["offload=full", f"offload.device_share={device_share}"] + SMALL_CHUNKS),
        expected,
        atol=1e-6,
    )


def test_device_share_takes_whole_chunks_from_the_end_of_backward():
    assert device_chunk_count([40, 10, 30, 20], 0.0) == 0
    assert device_chunk_count([40, 10, 30, 20], 0.2) == 1  # the last chunk, 20 of 100
    assert device_chunk_count([40, 10, 30, 20], 0.49) == 1  # 20 + 30 would pass 49
    assert device_chunk_count([40, 10, 30, 20], 0.6) == 3  # 20 + 30 + 10
    assert device_chunk_count([40, 10, 30, 20], 1.0) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "signsgd"])
def test_offload_modes_on_gpu(optimizer):
    """Side streams, pinned buffers and the in-backward worker on CUDA (bf16 compute). Full offload steps with
    the fused CPU kernel and its reference with the fused CUDA one; where their last-bit difference flips a bf16
    weight, that weight's later gradients differ, and AdamW's normalised update moves it by up to about lr per step
    whatever the gradient's size (5 of 32768 embedding entries by up to 3.0e-3 after 4 steps on an H200, with
    lr summing to 3.0e-3), and the flipped weights change every later gradient a little (18 % of the masters
    beyond 1e-5 on an H200). So: the median master within 1e-5, all within twice the summed lr; a missed copy or a
    stale weight moves most entries by about lr (1e-3), far more than 1e-5."""
    cuda = ["trainer.device=cuda", f"optimizer={optimizer}"]
    none = run_steps(cuda + ["offload=none"], device="cuda")
    assert_all_close(run_steps(cuda + ["offload=optimizer"] + SMALL_CHUNKS, device="cuda"), none, atol=1e-6)
    expected = reference_bf16_masters(cuda, device="cuda")
    cfg = compose_train([f"trainer.steps={STEPS}"] + cuda)
    for device_share in (0.0, 0.5):  # all on the host; half the parameters stepped on the device, on a side stream
        actual = run_steps(
            cuda + ["offload=full", f"offload.device_share={device_share}"] + SMALL_CHUNKS, device="cuda"
        )
        assert_all_close(actual, expected, atol=2 * sum(scheduled_lrs(cfg)))
        differences = torch.cat([(a - e).abs().flatten() for a, e in zip(actual, expected)])
        assert differences.median() <= 1e-5, device_share


def _world2_max_differences(optimizer: str) -> dict:
    """Largest difference, on this rank's shards, of each offload mode from offload=none."""
    mesh = ["trainer.nproc_per_node=2", "parallel.ep=2", f"optimizer={optimizer}"]
    reference = run_steps(mesh + ["offload=none"])
    out = {}
    for mode in (
        "optimizer",
        "full",
        "full offload.device_share=0.5",
    ):  # the last: FSDP2's shards stepped on the device
        weights = run_steps(mesh + f"offload={mode}".split() + SMALL_CHUNKS)
        out[mode] = max((w - r).abs().max().item() for w, r in zip(weights, reference))
    return out


@pytest.mark.slow
def test_offload_modes_match_none_world2_fsdp_ep2(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for differences in run_world(2, _world2_max_differences, "adamw"):
        assert max(differences.values()) <= 1e-6, differences


@pytest.mark.parametrize("mode", ["none", "optimizer", "full"])
def test_training_loop_runs_and_leaves_nothing_behind(tmp_path, mode):
    """A sweep runs its points in one process: once train() returns, no model or offload thread of it remains."""
    import gc

    from moe_lab.models.qwen3_moe import Qwen3MoeForCausalLM

    cfg = compose_train(
        [f"offload={mode}", "trainer.steps=3", "trainer.warmup_steps=1"] + (SMALL_CHUNKS if mode != "none" else [])
    )
    options = config.validate(cfg)
    threads = set(threading.enumerate())
    metrics = train(cfg, options, tmp_path, torch.device("cpu"), 0, 1)
    assert metrics["final_loss"] < metrics["first_loss"]
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, Qwen3MoeForCausalLM)]
    for thread in set(threading.enumerate()) - threads:
        if thread.name == "tqdm_monitor":  # tqdm's own, shared by every progress bar
            continue
        thread.join(timeout=5)
        assert not thread.is_alive(), thread.name


# ---- torch optimizers, driven by torch's LR schedulers ----

LR = 1e-2
CHUNK_MIB = 64 * 4 / 2**20  # 64 fp32 elements: one chunk per weight or bias below
OFFLOADS = {
    "none": lambda: NoOffload(),
    "optimizer": lambda: OptimizerOffload(chunk_mib=CHUNK_MIB, max_inflight=2),
    "full": lambda: FullOffload(chunk_mib=CHUNK_MIB, max_inflight=2, numa_bind=False),
    # the last two of the four chunks (72 of 172 parameters) step on the device
    "full_device_share": lambda: FullOffload(chunk_mib=CHUNK_MIB, max_inflight=2, numa_bind=False, device_share=0.5),
}


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 4))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    inputs, targets = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
    device = next(model.parameters()).device  # drawn on the CPU: the same batches on any device
    return F.mse_loss(model(inputs.to(device)), targets.to(device))


def _build(mode: str, model: nn.Module) -> torch.optim.Optimizer:
    return OFFLOADS[mode]().build(model, functools.partial(torch.optim.AdamW, lr=LR), torch.float32)


@pytest.mark.parametrize("mode", ["optimizer", "full", "full_device_share"])
def test_offload_optimizers_are_torch_optimizers_over_their_chunks_groups(mode):
    model = _small_model()
    optimizer = _build(mode, model)
    assert isinstance(optimizer, torch.optim.Optimizer)
    chunk_groups = [g for o in optimizer.chunk_optimizers for g in o.param_groups]
    assert len(optimizer.chunk_optimizers) >= 3
    if mode == "full_device_share":
        assert [c.on_device for c in optimizer.chunks] == [False, False, True, True]
    assert len(optimizer.param_groups) == len(chunk_groups)
    assert all(g is c for g, c in zip(optimizer.param_groups, chunk_groups))  # the same dicts, not copies


PIECES_MIB = 16 * 4 / 2**20  # 16 fp32 elements: offload=optimizer steps the 64-element weights in four pieces


@pytest.mark.parametrize("mode", ["optimizer", "optimizer_pieces", "full", "full_device_share"])
def test_offload_state_dict_is_per_parameter_and_loads_at_another_chunking(mode):
    """``state_dict()`` holds, for each parameter, the AdamW state plain torch AdamW holds after the same steps,
    shaped like the parameter (and offload=full's fp32 master, the weights), also where offload=optimizer steps a
    parameter in pieces or offload=full steps some chunks on the device; an optimizer of another chunking (all on the
    host) loads it and steps on exactly as the original, its groups still the ones an LR scheduler drives."""
    model, reference = _small_model(), _small_model()
    if mode == "optimizer_pieces":
        optimizer = OptimizerOffload(chunk_mib=PIECES_MIB).build(
            model, functools.partial(torch.optim.AdamW, lr=LR), torch.float32
        )
        assert any(not piece.whole for chunk in optimizer.chunks for piece in chunk.pieces)
        mode = "optimizer"
    else:
        optimizer = _build(mode, model)
    on_device = mode == "full_device_share"
    mode = mode.removesuffix("_device_share")
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(3):
        for m, o in ((model, optimizer), (reference, plain)):
            _loss(m, step).backward()
            o.step()
            o.zero_grad()
    state, expected = optimizer.state_dict(), plain.state_dict()
    assert sorted(state["state"]) == sorted(expected["state"]) == list(range(5))
    for i, p in enumerate(reference.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert state["state"][i][key].shape == p.shape, key
            torch.testing.assert_close(state["state"][i][key], expected["state"][i][key], atol=1e-6, rtol=0)
        assert float(state["state"][i]["step"]) == 3
        if mode == "full":
            torch.testing.assert_close(state["state"][i]["master"], p.detach(), atol=1e-6, rtol=0)
    assert {g["lr"] for g in state["param_groups"]} == {LR}

    resumed_model = _small_model()
    with torch.no_grad():
        for p, q in zip(resumed_model.parameters(), model.parameters()):
            p.copy_(q if mode != "full" else torch.zeros_like(q))  # offload=full takes its weights from the masters
    one_chunk = {"optimizer": OptimizerOffload(chunk_mib=1.0), "full": FullOffload(chunk_mib=1.0, numa_bind=False)}[
        mode
    ]
    resumed = one_chunk.build(resumed_model, functools.partial(torch.optim.AdamW, lr=LR), torch.float32)
    assert len(resumed.chunk_optimizers) == 1 < len(optimizer.chunk_optimizers)
    hyperparameters = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    groups = [{**g, **hyperparameters} for g in resumed.state_dict()["param_groups"]]
    resumed.load_state_dict({"state": state["state"], "param_groups": groups})
    assert resumed.param_groups[0] is resumed.chunk_optimizers[0].param_groups[0]
    for step in range(3, 6):
        for m, o in ((model, optimizer), (resumed_model, resumed)):
            _loss(m, step).backward()
            o.step()
            o.zero_grad()
    # exact within one placement; a chunk moved from the device (torch's AdamW) to the host (the step kernel) may
    # differ in the last bit
    assert_all_close(list(resumed_model.parameters()), list(model.parameters()), atol=1e-6 if on_device else 0)


@pytest.mark.parametrize(
    "chunk_numel, pieces",
    [
        (100, [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]),  # 100 rounds down to 64
        (200, [(0, 192), (192, 300)]),  # to 192
        (128, [(0, 128), (128, 256), (256, 300)]),  # already a multiple
    ],
)
def test_a_parameter_larger_than_a_chunk_is_split_into_pieces_of_a_multiple_of_64_elements(chunk_numel, pieces):
    """offload=optimizer (AdamW, element-wise) cuts a 300-element weight larger than its chunk into pieces of the
    chunk's size rounded down to a multiple of 64 elements (vectorised kernels), the last piece the rest; each piece
    starts a chunk of its own."""
    model = nn.Linear(30, 10, bias=False)
    optimizer = OptimizerOffload(chunk_mib=chunk_numel * 4 / 2**20).build(
        model, functools.partial(torch.optim.AdamW, lr=LR), torch.float32
    )
    assert [[(piece.start, piece.end) for piece in chunk.pieces] for chunk in optimizer.chunks] == [[p] for p in pieces]
    assert not any(piece.whole for chunk in optimizer.chunks for piece in chunk.pieces)


def test_zero_grad_clears_the_models_gradients():
    model = _small_model()
    optimizer = _build("optimizer", model)
    _loss(model, 0).backward()
    grads = [p.grad for p in model.parameters()]
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad.data_ptr() == g.data_ptr() and not g.any() for p, g in zip(model.parameters(), grads))
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("steps, warmup", [(6, 0), (6, 1), (6, 3), (4, 6)])
@pytest.mark.parametrize("mode", list(OFFLOADS))
def test_chunk_optimizers_step_with_the_scheduled_lr(mode, steps, warmup):
    """The LR each chunk's optimizer reads when it steps (during backward under offload=full) is step s's
    lr * f(s) of the schedule, with the scheduler stepped after each optimizer step."""
    model = _small_model()
    optimizer = _build(mode, model)
    inner = optimizer.chunk_optimizers if isinstance(optimizer, ChunkedOptimizer) else [optimizer]
    seen = []
    for chunk_optimizer in inner:
        chunk_optimizer.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.param_groups[0]["lr"]))
    scheduler = warmup_cosine(optimizer, steps, warmup, min_lr_ratio=0.1)
    for step in range(steps):
        _loss(model, step).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        want = LR * expected_factor(step, steps, warmup, 0.1)
        assert seen == pytest.approx([want] * len(inner), rel=1e-12), f"step {step}"
        seen.clear()


@pytest.mark.parametrize("mode", list(OFFLOADS))
def test_scheduled_offload_optimizers_match_plain_adamw(mode):
    """Each mode's optimizer, stepped with a closure and driven by warmup_cosine through warmup and decay, leaves
    the weights of plain torch AdamW whose LR is set by hand from the formula (fp32: full offload's fused CPU
    kernel agrees with the for-loop one to rounding)."""
    steps, warmup = 8, 3
    model, reference = _small_model(), _small_model()
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = _build(mode, model)
    scheduler = warmup_cosine(optimizer, steps, warmup, min_lr_ratio=0.1)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(steps):
        for group in plain.param_groups:
            group["lr"] = LR * expected_factor(step, steps, warmup, 0.1)
        _loss(reference, step).backward()
        plain.step()
        plain.zero_grad()

        losses = []

        def closure():
            losses.append(_loss(model, step))
            losses[-1].backward()
            return losses[-1]

        assert optimizer.step(closure) is losses[-1]
        scheduler.step()
        optimizer.zero_grad()
    weights = [p.detach() for p in model.parameters()]
    assert_all_close(weights, [p.detach() for p in reference.parameters()], atol=1e-6)
    assert all(not torch.equal(w, i) for w, i in zip(weights, initial))


# ---- offload=optimizer: the chunks step in the last micro-batch's backward ----


def _micro_batch_loss(model: nn.Module, step: int, micro_batch: int) -> torch.Tensor:
    return _loss(model, 10 * step + micro_batch) / 2  # two micro-batches: the mean over the step's batch


def _delay_side_streams(monkeypatch, cycles: int = 2_000_000) -> None:
    """Every side-stream copy and chunk step first sleeps on its stream (about 1 ms on an H200), after the waits
    that order it: a consumer that does not wait for it then reads what was there before."""
    copy, step_chunk = SideStream.copy, StreamedStateOptimizer._step_chunk

    def slow_copy(self, dst, src, after_current=True):
        if after_current:
            self.after_current()
        with self.use():
            torch.cuda._sleep(cycles)
        copy(self, dst, src, after_current=False)

    def slow_step_chunk(self, chunk):
        torch.cuda._sleep(cycles)  # on the steps stream: every call is inside its use()
        step_chunk(self, chunk)

    monkeypatch.setattr(SideStream, "copy", slow_copy)
    monkeypatch.setattr(StreamedStateOptimizer, "_step_chunk", slow_step_chunk)


@pytest.mark.parametrize("chunk_mib", [CHUNK_MIB, PIECES_MIB], ids=["whole", "pieces"])
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda_delayed", marks=pytest.mark.gpu)]
)
def test_optimizer_offload_steps_in_the_last_backward_like_plain_adamw(device, chunk_mib, monkeypatch):
    """Two micro-batches per step, the chunks' state larger than the device ring it passes through: the earlier
    micro-batch's backward steps nothing; from the second step on (the first creates the state, after backward) the
    last one's backward leaves, before ``step()`` is called, the weights plain AdamW leaves on the step's whole
    batch, whether its chunks hold whole parameters or pieces of them. On CUDA the chunks step on a stream of their
    own, their state copied in and out on two more. ``cuda_delayed``: each side-stream copy and chunk step is
    delayed on its stream and the device is never synchronized (weights compared after ``step()``, on the compute
    stream, while copies home still run): a missing wait between the streams reads stale state or weights."""
    delayed = device == "cuda_delayed"
    if delayed:
        device = "cuda"
        _delay_side_streams(monkeypatch)
    model, reference = _small_model().to(device), _small_model().to(device)
    offload = OptimizerOffload(chunk_mib=chunk_mib, max_inflight=2)
    optimizer = offload.build(model, functools.partial(torch.optim.AdamW, lr=LR), torch.float32)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    sync = torch.cuda.synchronize if device == "cuda" and not delayed else lambda: None
    for step in range(4):
        sum(_micro_batch_loss(reference, step, j) for j in range(2)).backward()
        plain.step()
        plain.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        for micro_batch in range(2):
            offload.before_micro_batch(optimizer, final=micro_batch == 1)
            _micro_batch_loss(model, step, micro_batch).backward()
            sync()
            if micro_batch == 0 or step == 0:
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), (step, micro_batch)
        if step > 0 and not delayed:  # the chunks' steps are ordered before the compute stream by step() only
            assert_all_close(
                [p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()], atol=1e-6
            )
        optimizer.step()
        optimizer.zero_grad()
        assert_all_close(
            [p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()], atol=1e-6
        )
        assert optimizer.ring.numel() < sum(c.nbytes for c in optimizer.chunks)  # so the ring's room is reused
    assert optimizer.ring.device.type == device
    assert all(chunk.host.is_pinned() == (device == "cuda") for chunk in optimizer.chunks)


class _Gated(nn.Module):
    """Four layers; ``b`` joins the forward from step 1 on, ``c`` from step 2 on, and the step's second micro-batch
    skips ``b``: chunks whose state grows after their first step, and gradients the last backward does not reach."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (
            nn.Linear(4, 4),
            nn.Linear(4, 4, bias=False),
            nn.Linear(4, 4),
            nn.Linear(4, 4, bias=False),
        )

    def forward(self, x: torch.Tensor, step: int, micro_batch: int) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        if step >= 1 and micro_batch == 0:
            x = torch.tanh(self.b(x))
        if step >= 2:
            x = torch.tanh(self.c(x))
        return self.d(x)


def test_optimizer_offload_with_state_that_grows_and_gradients_backward_misses_matches_plain_adamw():
    model, reference = _Gated(), _Gated()
    offload = OptimizerOffload(chunk_mib=40 * 4 / 2**20, max_inflight=1)  # two chunks, each with a late parameter
    optimizer = offload.build(model, functools.partial(torch.optim.AdamW, lr=LR), torch.float32)
    plain = torch.optim.AdamW(reference.parameters(), lr=LR)
    assert len(optimizer.chunks) == 2

    def loss(net, step, micro_batch):
        generator = torch.Generator().manual_seed(10 * step + micro_batch)
        inputs, targets = torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)
        return F.mse_loss(net(inputs, step, micro_batch), targets) / 2

    for step in range(5):
        sum(loss(reference, step, j) for j in range(2)).backward()
        plain.step()
        plain.zero_grad()
        for micro_batch in range(2):
            offload.before_micro_batch(optimizer, final=micro_batch == 1)
            loss(model, step, micro_batch).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert_all_close(
            [p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()], atol=1e-6
        )
    state = optimizer.state_dict()["state"]
    for i, p in enumerate(reference.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[i][key], plain.state[p][key], atol=1e-6, rtol=0)


# ---- the host step kernel ----


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("transfer_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "make_optimizer",
    [
        functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
        # eps of the gradients' scale: the default 1e-8 is below fp32 rounding of N(0, 1) gradients' moments
        functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=0.3),
        functools.partial(SignSGD, lr=1e-2, weight_decay=0.1),
    ],
    ids=["adamw", "adamw_eps", "signsgd"],
)
def test_host_step_is_the_optimizer_over_the_whole_masters(make_optimizer, transfer_dtype, threads):
    """The host step kernel, over flat masters of sizes no vector width divides and on any thread count, steps them
    as plain torch AdamW (within fp32 rounding: torch's kernel may fuse other multiply-adds) or SignSGD (exactly)
    steps them with the widened gradient, keeps torch's state, and leaves the new weights in the transfer buffer,
    rounded as torch rounds them (AdamW's NaN weight from a NaN gradient stays NaN there)."""
    torch.manual_seed(0)
    sizes = (1003, 301, 5)
    masters = [nn.Parameter(torch.randn(n)) for n in sizes]
    wholes = [nn.Parameter(m.detach().clone()) for m in masters]
    reference = make_optimizer(wholes)
    host = host_optimizer(make_optimizer, masters)
    assert type(host) is HOST_STEPS[make_optimizer.func]
    tolerance = dict(rtol=1e-6, atol=1e-7) if make_optimizer.func is torch.optim.AdamW else dict(rtol=0, atol=0)
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(4):
            transfer = torch.randn(sum(sizes)).to(transfer_dtype)
            if step == 3:
                transfer[7] = float("nan")
            for whole, grad in zip(wholes, transfer.float().split(sizes)):
                whole.grad = grad
            reference.step()
            host.step(transfer=transfer)
            for master, whole in zip(masters, wholes):
                torch.testing.assert_close(master, whole, equal_nan=True, **tolerance)
                assert reference.state[whole].keys() == host.state[master].keys()
                for key, value in reference.state[whole].items():  # AdamW's step count and moments
                    torch.testing.assert_close(host.state[master][key], value, equal_nan=True, **tolerance, msg=key)
            narrowed = torch.cat([m.detach() for m in masters]).to(transfer_dtype)
            nan_weights = step == 3 and make_optimizer.func is torch.optim.AdamW  # torch.sign(nan) is 0
            assert torch.equal(transfer.isnan(), narrowed.isnan()) and transfer.isnan().sum() == nan_weights
            assert torch.equal(transfer.nan_to_num(), narrowed.nan_to_num())
    finally:
        torch.set_num_threads(default_threads)


def test_host_step_kernel_releases_the_gil():
    """A Python thread runs while the kernel steps: it sees the kernel's first writes before its last (one thread
    writes the master in order), which it cannot while a call that holds the GIL runs."""
    numel = 2**26  # a step of about 20 ms: at 2**23 (3 ms) a watcher on a loaded 2-core machine missed 20 in a row
    master, transfer = torch.zeros(numel), torch.ones(numel, dtype=torch.bfloat16)
    seen_midway, returned, watching = threading.Event(), threading.Event(), threading.Event()

    def watch():
        watching.set()
        while not returned.is_set():
            if master[0].item() != 0 and master[-1].item() == 0:
                seen_midway.set()
                return

    for _ in range(20):  # the watcher may lose its CPU for a whole step on a loaded machine (1 in 3 on 2 cores): tries
        master.zero_()
        transfer.fill_(1.0)  # the gradient: the step leaves the new weights here
        returned.clear()
        watching.clear()
        watcher = threading.Thread(target=watch)
        watcher.start()
        watching.wait()
        host_kernel.signsgd_step(master, transfer, lr=1.0, weight_decay=0.0, threads=1)
        returned.set()
        watcher.join()
        assert master[-1].item() == -1.0
        if seen_midway.is_set():
            break
    assert seen_midway.is_set()


@pytest.mark.parametrize("broken", ["compiler", "cache"])
def test_offload_full_that_cannot_build_its_kernel_fails_when_built_naming_why(broken, monkeypatch, tmp_path):
    """No C compiler, or a kernel cache that cannot be written: the optimizer's construction fails (before training),
    naming offload=full and the compiler or the directory."""
    if broken == "compiler":
        monkeypatch.setenv("CC", "/nonexistent/cc")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no kernel built yet
        message = r"offload=full .*/nonexistent/cc"
    else:
        blocked = tmp_path / "a file"
        blocked.write_text("")  # the cache directory would have to be below a file
        monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
        message = r"offload=full caches its host step kernel in .*a file"
    host_kernel.load.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=message):
            _two_chunk_optimizer(SignSGD)
    finally:
        host_kernel.load.cache_clear()


def _two_chunk_optimizer(host_optimizer) -> tuple[InBackwardOptimizer, torch.Tensor]:
    """offload=full's optimizer over the two-chunk model with ``host_optimizer`` (a class), and the model's loss."""
    model, loss = _two_chunk_model()
    optimizer = InBackwardOptimizer(
        list(model.parameters()),
        functools.partial(host_optimizer, lr=0.1),
        torch.float32,
        chunk_numel=64,
        max_inflight=2,
        timeout_s=5,
        num_threads=1,
    )
    return optimizer, loss


def _stepped_two_chunk_optimizer(host_optimizer) -> InBackwardOptimizer:
    """``_two_chunk_optimizer`` after one step."""
    optimizer, loss = _two_chunk_optimizer(host_optimizer)
    optimizer.attach()
    loss.backward()
    optimizer.step()
    return optimizer


def test_the_worker_has_ended_when_its_finalizer_returns():
    """A failed run's traceback holds the optimizer until interpreter exit, where its finalizer runs: it returns once
    the worker has ended (a worker still freeing a chunk during finalization aborted the process, exit 134)."""
    optimizer = _stepped_two_chunk_optimizer(SignSGD)
    assert optimizer.stop_worker.atexit and optimizer.worker.is_alive()
    optimizer.stop_worker()
    assert not optimizer.worker.is_alive()


class _SwitchIntervalSeen(HostSignSGD):
    seen: list[float] = []

    def step(self, closure=None, **kwargs):
        self.seen.append(sys.getswitchinterval())
        return super().step(closure, **kwargs)


def test_host_step_hands_the_gil_over_promptly_and_reports_its_work():
    """The worker steps with Python's switch interval shortened (so that each return of the host step to Python
    gets the GIL soon beside a training thread running Python) and restores it; ``step_metrics()`` reports the
    host step's time, rate and ``step()``'s wait for it, once per step."""
    default = sys.getswitchinterval()
    optimizer = _stepped_two_chunk_optimizer(_SwitchIntervalSeen)
    assert _SwitchIntervalSeen.seen and max(_SwitchIntervalSeen.seen) <= HOST_STEP_SWITCH_INTERVAL_S < default
    assert sys.getswitchinterval() == default
    metrics = optimizer.step_metrics()
    assert metrics["host_step_s"] > 0 and metrics["host_step_gparams_per_s"] > 0 and metrics["host_wait_s"] >= 0
    assert optimizer.step_metrics()["host_step_s"] == 0  # nothing stepped since
    first, second = prompt_gil_handover(), prompt_gil_handover()  # two optimizers' workers, overlapping
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(HOST_STEP_SWITCH_INTERVAL_S)  # the other still steps
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == default


# ---- rules ----


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["offload=full", "optimizer=signsgd", "optimizer._target_=torch.optim.SGD"], "optimizer._target_"),
        (["offload=full", "trainer.grad_clip=1.0"], "trainer.grad_clip"),
        (["offload=optimizer", "trainer.grad_clip=1.0"], "trainer.grad_clip"),
        (["offload=full", "offload.timeout_s=0"], "offload.timeout_s"),
        (["offload=full", "offload.max_inflight=0"], "offload.max_inflight"),
        (["offload=full", "offload.threads=0"], "offload.threads"),
        (["offload=full", "offload.device_share=1.5"], "offload.device_share"),
        (["offload=optimizer", "offload.chunk_mib=0"], "offload.chunk_mib"),
        # not finite: a chunk's element count and the worker's wait have none (they failed after the model was built)
        (["offload=optimizer", "offload.chunk_mib=inf"], "offload.chunk_mib"),
        (["offload=full", "offload.chunk_mib=nan"], "offload.chunk_mib"),
        (["offload=full", "offload.timeout_s=inf"], "offload.timeout_s"),
        (["offload=full", "offload.timeout_s=nan"], "offload.timeout_s"),
        (["offload=full", "+optimizer.amsgrad=true"], "optimizer.amsgrad"),  # the host kernel's AdamW has no path
        (["offload=full", "+optimizer.maximize=true"], "optimizer.maximize"),
    ],
)
def test_rules_fail_with_their_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        config.validate(compose_train(overrides))
    assert e.value.key == key and key in str(e.value)


@pytest.mark.parametrize(
    "overrides, plain_class",
    [
        (["offload=full", "optimizer=adamw"], torch.optim.AdamW),
        (["offload=full", "optimizer=signsgd"], SignSGD),
        (
            ["offload=optimizer", "optimizer=signsgd", "optimizer._target_=torch.optim.SGD"],
            torch.optim.SGD,
        ),  # any torch optimizer
    ],
)
def test_offload_accepts_its_optimizers_with_clipping_off(overrides, plain_class):
    """With gradient clipping off (the default) each pair validates, and the offload optimizer it builds from the
    validated options steps like the plain optimizer the same options make."""
    cfg = compose_train(overrides)
    assert cfg.trainer.grad_clip is None
    options = config.validate(cfg)
    model, reference = _small_model(), _small_model()
    optimizer = options.offload.build(model, options.make_optimizer, torch.float32)
    plain = options.make_optimizer(reference.parameters())
    assert type(plain) is plain_class
    for step in range(3):
        _loss(reference, step).backward()
        plain.step()
        plain.zero_grad()
        optimizer.step(lambda step=step: _loss(model, step).backward())
        optimizer.zero_grad()
    assert_all_close([p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()], atol=1e-6)


# ---- NUMA binding, on a fake sysfs tree ----


def fake_sysfs(root: Path, gpu_nodes: dict[str, str], node_cpulists: dict[int, str]) -> Path:
    for address, node in gpu_nodes.items():
        (root / "bus/pci/devices" / address).mkdir(parents=True)
        (root / "bus/pci/devices" / address / "numa_node").write_text(node + "\n")
    for node, cpulist in node_cpulists.items():
        (root / "devices/system/node" / f"node{node}").mkdir(parents=True)
        (root / "devices/system/node" / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    return root


def test_parse_cpulist():
    assert numa.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


def test_rank_cpus_splits_the_node_between_its_gpus(tmp_path):
    gpus = {"0000:18:00.0": "0", "0000:2a:00.0": "0", "0000:9a:00.0": "1"}
    root = fake_sysfs(tmp_path, gpus, {0: "0-7,32-39", 1: "8-15"})
    addresses = list(gpus)
    assert numa.rank_cpus(addresses[0], addresses, root) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert numa.rank_cpus(addresses[1], addresses, root) == [32, 33, 34, 35, 36, 37, 38, 39]
    assert numa.rank_cpus(addresses[2], addresses, root) == list(range(8, 16))


def test_rank_cpus_skips_a_gpu_without_node_with_a_warning(tmp_path, caplog):
    root = fake_sysfs(tmp_path, {"0000:18:00.0": "-1"}, {})
    assert numa.rank_cpus("0000:18:00.0", ["0000:18:00.0"], root) is None
    assert "no NUMA node" in caplog.text


def test_missing_topology_is_a_clear_error(tmp_path):
    with pytest.raises(numa.NumaTopologyError, match="numa_node"):
        numa.rank_cpus("0000:18:00.0", ["0000:18:00.0"], tmp_path)
    root = fake_sysfs(tmp_path, {"0000:18:00.0": "0"}, {})
    with pytest.raises(numa.NumaTopologyError, match="cpulist"):
        numa.rank_cpus("0000:18:00.0", ["0000:18:00.0"], root)


def test_validate_rejects_a_gpu_host_without_sysfs_topology(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # the target's GPU
    monkeypatch.setattr(runtime_device, "gpu_pci_address", lambda gpu: "0000:18:00.0")
    cfg = compose_train(["offload=full", f"offload.sysfs_root={tmp_path}"])
    with pytest.raises(ConfigError) as e:
        config.validate(cfg)
    assert e.value.key == "offload.numa_bind" and "numa_node" in str(e.value)
    fake_sysfs(tmp_path, {"0000:18:00.0": "0"}, {0: "0-1"})
    config.validate(cfg)
    config.validate(compose_train(["offload=full", "offload.numa_bind=false", "offload.sysfs_root=/nonexistent"]))


def test_planning_offload_full_touches_no_cuda(monkeypatch):
    """A plan's target is its profile's GPUs, not this machine's: validating offload=full for it reads no GPU here.
    The tune plans in forked workers, where CUDA cannot start again once the parent started it (every offload=full
    point failed to plan so on the H100 and H200 tunes: experiments/tune/records/h100_30b_8gpu/2026-12-06_14-19)."""

    def forked(*args, **kwargs):
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", forked)
    result = plan(compose_plan(["offload=full", "offload.numa_bind=true", "hardware=h100"]), search=False)
    assert result["metrics"]["s_per_step"] > 0


def test_bind_threads_pins_this_process(tmp_path):
    before = sorted(os.sched_getaffinity(0))
    try:
        assert numa.bind_threads(before[:1]) == before[:1]
        assert sorted(os.sched_getaffinity(0)) == before[:1]
    finally:
        numa.bind_threads(before)


# ---- failures surface as errors, not hangs ----


class _BlockedSignSGD(HostSignSGD):
    def __init__(self, params, release: threading.Event, fail: bool = False, **kw):
        super().__init__(params, **kw)
        self.release, self.fail = release, fail

    def step(self, closure=None, **kwargs):
        self.release.wait(30)
        if self.fail:
            raise ValueError("injected failure")
        return super().step(closure, **kwargs)


def _two_chunk_model():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    return model, model(torch.randn(4, 8)).square().sum()


def test_stuck_worker_times_out_in_backward():
    release = threading.Event()
    model, loss = _two_chunk_model()
    optimizer = InBackwardOptimizer(
        list(model.parameters()),
        functools.partial(_BlockedSignSGD, release=release, lr=0.1),
        torch.float32,
        chunk_numel=64,
        max_inflight=1,
        timeout_s=0.2,
        num_threads=1,
    )
    optimizer.attach()
    try:
        with pytest.raises(TimeoutError, match="offload.timeout_s"):
            loss.backward()
    finally:
        release.set()


def test_worker_failure_is_raised_not_swallowed():
    release = threading.Event()
    release.set()
    model, loss = _two_chunk_model()
    optimizer = InBackwardOptimizer(
        list(model.parameters()),
        functools.partial(_BlockedSignSGD, release=release, fail=True, lr=0.1),
        torch.float32,
        chunk_numel=64,
        max_inflight=2,
        timeout_s=5,
        num_threads=1,
    )
    optimizer.attach()
    with pytest.raises(ValueError, match="injected failure") as e:  # from the next hook, or else from step()
        loss.backward()
        optimizer.step()
    assert "offload=full CPU optimizer worker" in e.value.__notes__[0]


def test_host_memory_shortage_is_an_oom_before_allocating():
    with pytest.raises(torch.OutOfMemoryError, match="host memory: offload=full test needs"):
        check_host_memory(2**50, "offload=full test")


def test_collected_optimizer_ends_its_worker_and_frees_its_host_state():
    """A sweep runs its points in one process: once a point's model, optimizer and LR scheduler go, so do the worker
    thread and the host masters and moments it stepped."""
    import gc
    import weakref

    model, loss = _two_chunk_model()
    optimizer = InBackwardOptimizer(
        list(model.parameters()),
        functools.partial(torch.optim.AdamW, lr=0.1),
        torch.float32,
        chunk_numel=64,
        max_inflight=2,
        timeout_s=5,
        num_threads=1,
    )
    optimizer.attach()
    scheduler = warmup_cosine(optimizer, steps=4, warmup_steps=2, min_lr_ratio=0.1)  # it wraps optimizer.step
    loss.backward()
    optimizer.step()
    scheduler.step()
    worker, collected, master = optimizer.worker, weakref.ref(optimizer), weakref.ref(optimizer.chunks[0].master)
    del loss, optimizer, scheduler
    gc.collect()
    worker.join(timeout=5)
    assert collected() is None and master() is None
    assert not worker.is_alive()
    model(torch.randn(4, 8)).sum().backward()  # a model that outlives its optimizer still trains, unstepped
    assert all(p.grad is not None for p in model.parameters())


def test_each_sweep_point_reports_its_own_peak_host_memory():
    from moe_lab.job.trainer import peak_host_rss_gib, reset_peak_host_rss

    ballast = torch.ones(2**28, dtype=torch.uint8)  # 256 MiB touched
    del ballast
    before = peak_host_rss_gib()
    reset_peak_host_rss()
    assert peak_host_rss_gib() < before - 0.2
