"""Activation checkpointing changes memory, not maths (issue 2, acceptance 3): ac=full and ac=selective give the same
loss and gradients as ac=none, at world 1 and at world 2 with EP=2 (FSDP2 + the torch dispatcher's all-to-all, or
the fused op with its data-dependent residual sizes), where they also equal the world-1 step on the same global batch.
Recompute is observed, not assumed: the ops run during backward show that full re-runs routing and attention,
selective re-runs norms only and never a routing decision or a collective. ac.offload_activations' hooks, on chained
toy blocks against plain autograd: a tensor saved twice in a block goes to the host once, and a block's tensors come
back while the block after it runs backward (xfail: only the block before the last does today)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lab import config
from moe_lab.data.synthetic import SyntheticData
from moe_lab.models.hf_weights import load_hf_checkpoint, save_hf_checkpoint
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from moe_lab.moe.dispatcher import FusedDispatcher, TorchDispatcher
from moe_lab.moe.router import Router
from moe_lab.parallel import activation_offload, parallelize
from moe_lab.parallel.ac import SelectiveCheckpoint
from moe_lab.parallel.activation_offload import ActivationOffload
from moe_lab.parallel.expert_parallel import apply_expert_parallel
from tests.configs import compose_train
from tests.distributed import run_world

MODES = ("none", "full", "selective")
SEQ, GLOBAL_BATCH = 16, 4  # tokens per sample, samples per step over all ranks
# Namespaces of the ops selective checkpointing must save rather than re-run: functional collectives and this
# project's custom ops (dispatch / combine). FSDP's own gathers (namespace c10d) are not part of a block.
COLLECTIVE_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "moe_lab")
NOT_COMMUNICATION = {"_wrap_tensor_autograd"}  # marks an async collective's result for autograd; moves no data


class OpCounter(TorchDispatchMode):
    """Calls per op, by name (``counts``) and by overload (``overloads``)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.overloads = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace in COLLECTIVE_NAMESPACES and name not in NOT_COMMUNICATION:
            name = f"{func.namespace}::{name}"
        self.counts[name] += 1
        self.overloads[func] += 1
        return func(*args, **(kwargs or {}))


def resolved_configs(routing: str, world: int, dispatcher: str = "torch") -> dict[str, str]:
    overrides = [f"model.routing={routing}", f"data.seq_len={SEQ}", f"dispatcher={dispatcher}"]
    if world > 1:
        overrides += [f"trainer.nproc_per_node={world}", f"parallel.ep={world}"]
    return {m: OmegaConf.to_yaml(compose_train(*overrides, f"ac={m}"), resolve=True) for m in MODES}


def write_checkpoint(directory: Path, yaml: str) -> None:
    """One set of fp32 weights for every mode and world size."""
    torch.manual_seed(0)
    model = instantiate(OmegaConf.create(yaml).model).build()
    model.init_weights()
    save_hf_checkpoint(model.state_dict(), directory)


def train_step(yaml: str, checkpoint: str) -> dict:
    """Forward and backward of one batch through the real build path (meta init, parallelize, checkpoint load).
    Returns the global mean loss, full gradients (experts: this rank's slice) and the ops run in backward."""
    cfg = OmegaConf.create(yaml)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    with torch.device("meta"):
        model = instantiate(cfg.model).build()
    options = config.build_options(cfg)
    parallelize(
        model,
        options.dispatcher,
        options.ac,
        ep=cfg.parallel.ep,
        compile=cfg.trainer.compile,
        device=torch.device("cpu"),
        compute_dtype=torch.float32,
    )
    model.to_empty(device="cpu")
    load_hf_checkpoint(model, checkpoint)
    batch = SyntheticData(SEQ, GLOBAL_BATCH, cfg.model.vocab_size).batch(0, 0, 1)
    inputs, labels = batch.inputs, batch.labels
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    inputs, labels = inputs[mine], labels[mine]
    loss = F.cross_entropy(model(inputs).logits.flatten(0, 1), labels.flatten())
    with OpCounter() as ops:
        loss.backward()
    loss = loss.detach()
    if world > 1:
        dist.all_reduce(loss)
    # numpy, not tensors: tensors leave a rank process through shared memory that dies with it
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).numpy().copy()
        for name, p in model.named_parameters()
    }
    return {"loss": loss.item() / world, "grads": grads, "ops": dict(ops.counts)}


def train_steps(configs: dict[str, str], checkpoint: str) -> dict[str, dict]:
    return {mode: train_step(yaml, checkpoint) for mode, yaml in configs.items()}


def assert_same_step(step: dict, reference: dict, expert_slice: slice | None = None) -> None:
    assert step["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert step["grads"].keys() == reference["grads"].keys()
    for name, grad in step["grads"].items():
        grad, ref = torch.from_numpy(grad), torch.from_numpy(reference["grads"][name])
        if expert_slice is not None and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            ref = ref[expert_slice]
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def assert_recompute(steps: dict[str, dict]) -> None:
    none, full, selective = (steps[m]["ops"] for m in MODES)
    layers = 2  # the tiny model
    attention = "_scaled_dot_product_flash_attention_for_cpu"
    assert none.get("rsqrt", 0) == 0 and none.get(attention, 0) == 0 and none.get("topk", 0) == 0
    # full: every block's forward runs again, attention and routing included
    assert full.get(attention, 0) == layers and full.get("rsqrt", 0) >= 3 * layers
    # selective: norms are recomputed; attention, matmuls, routing and collectives are not
    assert selective.get("rsqrt", 0) == full["rsqrt"]
    collectives = {op for op in {**none, **selective} if op.partition("::")[0] in COLLECTIVE_NAMESPACES}
    for op in (attention, "topk", "sort", "bincount", "mm", "_grouped_mm", *collectives):
        assert selective.get(op, 0) == none.get(op, 0), (
            f"ac=selective re-ran {op} in backward ({selective.get(op, 0)} calls vs {none.get(op, 0)} with ac=none): "
            "its output belongs in the saved_ops of the router or the dispatcher"
        )


@pytest.mark.parametrize("routing", ["learned", "balanced"])
def test_ac_modes_agree_world1(routing, tmp_path):
    configs = resolved_configs(routing, world=1)
    write_checkpoint(tmp_path, configs["none"])
    steps = train_steps(configs, str(tmp_path))
    assert steps["full"]["ops"].get("topk", 0) == (2 if routing == "learned" else 0)  # learned routing re-routes
    for mode in ("full", "selective"):
        assert_same_step(steps[mode], steps["none"])
    assert_recompute(steps)


@pytest.mark.parametrize("dispatcher", ["torch", "fused"])
@pytest.mark.slow
def test_ac_modes_agree_world2_ep2(dispatcher, tmp_path):
    configs = resolved_configs("learned", world=2, dispatcher=dispatcher)
    write_checkpoint(tmp_path, configs["none"])
    world1 = train_step(resolved_configs("learned", world=1, dispatcher=dispatcher)["none"], str(tmp_path))
    per_rank = run_world(2, train_steps, configs, str(tmp_path))
    for rank, steps in enumerate(per_rank):
        for mode in ("full", "selective"):
            assert_same_step(steps[mode], steps["none"])
        assert_recompute(steps)
        assert any("::" in op for op in steps["none"]["ops"])  # the all-to-all really ran in backward
        # FSDP2 + EP=2 on two ranks takes the same step as one rank on the same global batch
        assert_same_step(steps["none"], world1, expert_slice=slice(rank * 4, (rank + 1) * 4))


def selective_step_ops(dispatcher, saved_ops: dict) -> tuple[collections.Counter, collections.Counter]:
    """Ops run in the forward and in the backward of one step of the tiny model under ac=selective."""
    torch.manual_seed(0)
    model = Qwen3MoeConfig.preset("tiny").build()
    model.init_weights()
    apply_expert_parallel(model, dispatcher, 0, 1)
    SelectiveCheckpoint().apply(model, saved_ops=saved_ops)
    tokens = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with OpCounter() as forward:
        loss = model(tokens).logits.square().mean()
    with OpCounter() as backward:
        loss.backward()
    return forward.overloads, backward.overloads


@pytest.mark.parametrize(
    "dispatcher", [TorchDispatcher(), FusedDispatcher(backend="reference")], ids=["torch", "fused"]
)
def test_selective_keeps_the_declared_ops(dispatcher):
    """What ac=selective keeps beyond matmuls and attention is what the router and the dispatcher declare: with
    their saved_ops (as moe_lab.parallel.parallelize passes them) none of those ops runs again in backward; with
    the generic ops only, recompute re-runs every one of them."""
    declared = Router.saved_ops | dispatcher.saved_ops
    forward, kept = selective_step_ops(dispatcher, {"router": Router.saved_ops, "dispatcher": dispatcher.saved_ops})
    _, generic_only = selective_step_ops(dispatcher, {})
    ran = {op for op in declared if forward[op]}
    expected = {torch.ops.aten.topk.default}  # learned routing
    expected |= (
        {torch.ops.moe_lab.fused_moe.default}
        if isinstance(dispatcher, FusedDispatcher)
        else {torch.ops.aten.sort.stable, torch.ops.aten.bincount.default}
    )
    assert ran >= expected, ran
    for op in ran:
        assert kept[op] == 0, f"{op} re-ran in backward although declared"
        assert generic_only[op] == forward[op], (
            f"{op}: {generic_only[op]} calls in backward without it, {forward[op]} in forward"
        )


class _SineSquared(torch.nn.Module):
    """sin(x)^2 as ``y * y``: autograd saves the block's input once (sin) and y twice (mul), as the same tensor."""

    def forward(self, x):
        y = x.sin()
        return y * y


def _offloaded_blocks(num_blocks: int, monkeypatch):
    """``num_blocks`` chained blocks under ac.offload_activations (every tensor large enough to move), run forward on
    one input; -> (the offload, the input, each block's output)."""
    monkeypatch.setattr(activation_offload, "MIN_BYTES", 0)
    blocks = [_SineSquared() for _ in range(num_blocks)]
    offload = ActivationOffload(blocks)
    x = torch.randn(16, requires_grad=True, generator=torch.Generator().manual_seed(0))
    outputs = [x]
    for block in blocks:
        outputs.append(block(outputs[-1]))
    return offload, x, outputs[1:]


def test_offload_copies_a_tensor_saved_twice_in_a_block_once(monkeypatch):
    """Each block but the last sends its input and y to the host, y once though mul saved it twice; the gradient is
    the plain one."""
    offload, x, outputs = _offloaded_blocks(3, monkeypatch)
    assert offload.moved == {"tensors": 2 * 2, "bytes": 2 * 2 * 16 * 4}
    outputs[-1].sum().backward()
    plain = x.detach().clone().requires_grad_()
    plain.sin().square().sin().square().sin().square().sum().backward()
    torch.testing.assert_close(x.grad, plain.grad, rtol=0, atol=0)


def _fetched_when_each_block_starts_backward(num_blocks: int, monkeypatch) -> dict[int, list[bool]]:
    """Block i -> which blocks' saved tensors were back on the device when the gradient of block i's output was
    ready (block i + 1's backward done, block i's not begun)."""
    offload, _, outputs = _offloaded_blocks(num_blocks, monkeypatch)
    fetched = {}

    def record(index):
        def hook(grad):
            fetched[index] = [block.fetched for block in offload.blocks]

        return hook

    for index, output in enumerate(outputs[:-1]):
        output.register_hook(record(index))
    outputs[-1].sum().backward()
    return fetched


def test_offload_brings_the_block_before_the_last_back_during_the_last_blocks_backward(monkeypatch):
    """The last block's backward (the first to run) fetches the block before it, so that copy overlaps it."""
    fetched = _fetched_when_each_block_starts_backward(3, monkeypatch)
    assert fetched[1] == [False, True, True]


def test_offload_brings_each_block_back_while_the_block_after_it_runs_backward(monkeypatch):
    """Every block's saved tensors are back on the device before its backward begins (each copy in overlaps the
    backward of the block after it), not fetched on demand at its first unpack."""
    fetched = _fetched_when_each_block_starts_backward(5, monkeypatch)
    for index in range(4):
        assert fetched[index][index], f"block {index} not back when its backward began: {fetched[index]}"
