"""FSDP2's order of gathers (moe_lab/parallel/fsdp.py), seen from one process as rank 0 of an emulated world of 2
(``moe_lab.parallel.emulate``; dense weights and, at EP 1, the experts sharded over both ranks): in forward each group
gathers the next group's weights as it starts (embedding, each block with its experts, final norm + LM head), so a
gather never waits for the CPU to reach its group (the dispatchers read row counts back to the host every layer).
What the gathers hold and how gradients are reduced is tested where every mesh shape trains like one rank
(tests/test_distributed_training.py, tests/test_hsdp.py, tests/test_grad_accum.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moe_lab import config
from moe_lab.job.trainer import build_model
from moe_lab.parallel.emulate import init_emulated_world
from tests.configs import compose_train

SEQ = 16


@pytest.fixture
def emulated_model():
    """The tiny model as the trainer builds it on emulated rank 0 of 2 (EP 1, fp32), and a log of what happens in
    order: ("gather", elements) for each FSDP2 all-gather, ("forward", group) as each group's forward begins."""
    init_emulated_world(0, 2)
    all_gather = dist.all_gather_single  # what FSDP2's all-gathers call
    try:
        cfg = compose_train("model=tiny", "trainer.nproc_per_node=2", "parallel.ep=1", "trainer.precision=fp32")
        model = build_model(cfg, config.build_options(cfg), torch.device("cpu"), torch.float32)
        log = []

        def gathering(output, local, *args, **kwargs):
            log.append(("gather", local.numel()))
            return all_gather(output, local, *args, **kwargs)

        dist.all_gather_single = gathering
        groups = {"embedding": model.model.embed_tokens, "head": model.lm_head}
        groups |= {f"block {i}": layer for i, layer in enumerate(model.model.layers)}
        for name, module in groups.items():  # after FSDP2's own pre-forward hooks: its gathers come first
            module.register_forward_pre_hook(lambda module, args, name=name: log.append(("forward", name)))
        yield model, log
    finally:
        dist.all_gather_single = all_gather
        dist.destroy_process_group()


def gathers_before_each_forward(log: list) -> dict[str, int]:
    gathers, before = 0, {}
    for kind, what in log:
        if kind == "gather":
            gathers += 1
        else:
            before[what] = gathers
    return before


def test_each_group_gathers_the_next_groups_weights_as_it_starts_forward(emulated_model):
    """One gather for the embedding, two for each block (its dense weights, its experts), one for norm + head: by the
    time a group's forward begins, the next group's gathers have been issued too."""
    model, log = emulated_model
    model(torch.randint(0, 512, (1, SEQ)))
    assert gathers_before_each_forward(log) == {"embedding": 1 + 2, "block 0": 3 + 2, "block 1": 5 + 1, "head": 6}
