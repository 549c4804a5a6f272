"""dispatcher.save on CUDA (``gpu`` marker): the gpu backend (torch and, where importable, DeepGEMM GEMMs) gives the
same output and gradients bit for bit under rows, rows_only, gate_up and inputs (backward reruns forward's own kernels on the
same inputs) and holds less after forward; a compiled block with save=inputs matches save=rows; at EP=2 save=inputs
pulls the rows again from the peer's symmetric memory and matches too."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from moe_lab.moe.dispatcher import FusedDispatcher
from tests.fused_cases import bf16_op
from tests.test_fused_gpu import SHAPES, E, backends, make_problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SAVES = ("rows", "rows_only", "gate_up", "inputs")


def run_save(backend, save, x, ids, weights, gate_up_proj, down_proj, grad_out, group_name=""):
    inputs = [t.clone().requires_grad_() for t in (x, weights, gate_up_proj, down_proj)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = bf16_op(inputs[0], ids, *inputs[1:], E, group_name, backend, save)[0]
    held = torch.cuda.memory_allocated() - before  # what forward left for backward
    grads = torch.autograd.grad(y, inputs, grad_out)
    return [y.detach(), *grads], held


@pytest.mark.parametrize("routing", ["balanced", "skewed"])
def test_saves_equal_rows_bitwise_on_gpu(routing):
    problem = make_problem(*SHAPES["30b"], 4096, routing)
    for backend in backends():
        results = {save: run_save(backend, save, *problem) for save in SAVES}
        for save in SAVES[1:]:
            for name, g, e in zip(("y", "dx", "dweights", "dgate_up", "ddown"), results[save][0], results["rows"][0]):
                assert torch.equal(g, e), (
                    f"{backend} save={save}: {name} differs by {(g.float() - e.float()).abs().max()}"
                )
        held = {save: results[save][1] for save in SAVES}
        assert held["inputs"] < held["gate_up"] < held["rows"] and held["inputs"] < held["rows_only"] < held["rows"], (
            backend,
            held,
        )


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_block_with_save_inputs_compiles_and_matches_rows(ac):
    from moe_lab.models.qwen3_moe import Qwen3MoeConfig
    from moe_lab.moe.router import Router
    from moe_lab.parallel.ac import FullCheckpoint, NoCheckpoint, SelectiveCheckpoint
    from moe_lab.parallel.compile import apply_compile
    from moe_lab.parallel.expert_parallel import apply_expert_parallel

    def grads(save):
        cfg = Qwen3MoeConfig.preset(
            "tiny",
            num_layers=2,
            hidden_size=256,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
        )
        torch.manual_seed(0)
        model = cfg.build().cuda()
        model.init_weights()
        model.to(torch.bfloat16)
        dispatcher = FusedDispatcher(backend="gpu", save=save)
        apply_expert_parallel(model, dispatcher, 0, 1)
        {"none": NoCheckpoint, "selective": SelectiveCheckpoint, "full": FullCheckpoint}[ac]().apply(
            model, saved_ops={"router": Router.saved_ops, "dispatcher": dispatcher.saved_ops}
        )
        apply_compile(model)
        tokens = torch.randint(0, 512, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        model(tokens).logits.float().square().mean().backward()
        return {name: p.grad.float() for name, p in model.named_parameters()}

    rows, inputs = grads("rows"), grads("inputs")
    for name, g in rows.items():
        err = ((inputs[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert err < 1e-3, (name, err)  # the same kernels on the same values: bitwise in practice


def _ep_worker(rank, ep, port, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"
    )
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=ep, device_id=torch.device("cuda", rank))
    try:
        failures = []
        for routing in ("balanced", "skewed"):
            x, ids, weights, gate_up_proj, down_proj, grad_out = make_problem(*SHAPES["30b"], 2048, routing, seed=rank)
            local = slice(rank * E // ep, (rank + 1) * E // ep)
            problem = (x, ids, weights, gate_up_proj[local].contiguous(), down_proj[local].contiguous(), grad_out)
            name = dist.group.WORLD.group_name
            results = {save: run_save("gpu", save, *problem, group_name=name)[0] for save in SAVES}
            for save in SAVES[1:]:
                for what, g, e in zip(("y", "dx", "dweights", "dgate_up", "ddown"), results[save], results["rows"]):
                    if not torch.equal(g, e):
                        failures.append(
                            f"{routing} save={save}: {what} by {(g.float() - e.float()).abs().max().item()}"
                        )
        queue.put((rank, failures))
    except BaseException as e:
        queue.put((rank, repr(e)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_save_inputs_pulls_rows_from_peers_at_ep2():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ep_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == {0: [], 1: []}, results
