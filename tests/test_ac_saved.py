"""Issue 43: a compiled ac=full block keeps only its input and its weights for backward, the torch dispatcher at EP 2
included; every routed row ([tokens x top-k, ...]: the gathered rows, gate/up, the SwiGLU output) is recomputed.

torch 2.11 (the GPU machines') tagged plain checkpoint's region on dynamo's graph, leaving the ops of the torch
dispatcher's ``gather_rows`` (an ``autograd.Function``) untagged; its partitioner then kept their [tokens x top-k,
hidden] output per block (0.5 GiB a layer on Qwen3-30B-A3B at seq 16384). Run under torch 2.11 this test fails
without ``FullCheckpoint``'s recompute policy; torch 2.13 tags them either way.

One process as rank 0 of an emulated world of 2 (``moe_lab.parallel.emulate``): FSDP2 and the dispatcher's
all-to-alls run on the mirrored stand-in peer, with the real rank's shapes. Balanced routing, so the routed rows are
known: tokens x top-k sent, as many received. The MoE's 2I (96) differs from the hidden size (64), so a kept
gate/up output and a kept row gather are told apart.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lab import config
from moe_lab.job.trainer import build_model
from moe_lab.parallel.emulate import init_emulated_world
from tests.configs import compose_train
from tests.test_compile import can_compile

EP, BATCH, SEQ = 2, 2, 48
MOE_INTERMEDIATE = 48  # 2I = 96, not the tiny model's hidden size 64


def step(ac: str, compiled: bool) -> dict:
    """One forward and backward of emulated rank 0 of 2; the shapes each block saved for backward, the block input's
    shape, the layers' weight shapes, the loss and the gradients."""
    init_emulated_world(0, EP)
    try:
        cfg = compose_train(
            "model=tiny",
            "dispatcher=torch",
            f"ac={ac}",
            f"trainer.compile={str(compiled).lower()}",
            "trainer.precision=bf16",
            f"parallel.ep={EP}",
            f"trainer.nproc_per_node={EP}",
            f"model.moe_intermediate_size={MOE_INTERMEDIATE}",
            "model.routing=balanced",
            f"data.seq_len={SEQ}",
            f"data.batch_size={BATCH}",
        )
        model = build_model(cfg, config.build_options(cfg), torch.device("cpu"), torch.bfloat16)
        saved: list[list[tuple]] = []

        def recording(forward):
            def call(*args, **kwargs):
                shapes = []
                saved.append(shapes)

                def pack(t):
                    shapes.append((tuple(t.shape), t.dtype))
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return forward(*args, **kwargs)

            return call

        for layer in model.model.layers:
            layer.forward = recording(layer.forward)
        gen = torch.Generator().manual_seed(0)
        inputs = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ + 1), generator=gen)
        logits = model(inputs[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), inputs[:, 1:].flatten())
        loss.backward()
        layer = model.model.layers[0]
        return {
            "saved": saved,
            "weights": {(tuple(p.shape), torch.bfloat16) for p in layer.parameters()},
            "loss": loss.item(),
            "grads": {n: p.grad.full_tensor().float() for n, p in model.named_parameters()},
        }
    finally:
        dist.destroy_process_group()


def test_compiled_full_ac_keeps_no_routed_rows(monkeypatch):
    if reason := can_compile():
        pytest.skip(reason)
    # Inductor's decompositions and partitioner, run eagerly: what the blocks keep without compiling kernels.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager_decomp_partition"))
    full, eager = step("full", compiled=True), step("none", compiled=False)
    routed = BATCH * SEQ * compose_train("model=tiny").model.num_experts_per_tok
    block_input = ((BATCH, SEQ, 64), torch.bfloat16)
    assert len(full["saved"]) == 2  # the tiny model's blocks, each called once
    for shapes in full["saved"]:
        assert block_input in shapes
        rows = [s for s, _ in shapes if s and s[0] == routed]
        assert not rows, f"full AC kept routed rows for backward: {rows}"
        # Beyond the weights, nothing larger than the block's input: the routing statistics, a CPU RNG state.
        input_bytes = BATCH * SEQ * 64 * 2
        others = [(s, d) for s, d in shapes if (s, d) not in full["weights"] and (s, d) != block_input]
        too_large = [(s, d) for s, d in others if torch.Size(s).numel() * d.itemsize > input_bytes]
        assert not too_large, f"full AC kept more than the block input: {too_large}"
    # Same maths: the loss to bf16 rounding (inductor fuses elementwise work differently), the gradients likewise.
    assert full["loss"] == pytest.approx(eager["loss"], rel=2e-3)
    for name, grad in eager["grads"].items():
        cosine = F.cosine_similarity(full["grads"][name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.999, f"{name}: gradient cosine {cosine:.5f} against eager"
