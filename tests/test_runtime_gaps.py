"""Gaps a mutation audit found in the tests of the parallel layer, the metrics, the runtime helpers, validation and
the launcher: behaviour no other test pinned down, each checked against a reference worked out by hand (the mesh
layout's formula, plain torch ops, a one-process model).

- Meshes (``moe_lab.parallel.mesh``): every rank's dense, expert-shard and EP groups, 1-D with one replica and 2-D
  with replicas, as the documented layout formula places them; ``grid_ranks`` agrees.
- Expert parallelism and FSDP2 (``moe_lab.parallel.expert_parallel``, ``fsdp``, ``sharding``): an EP rank keeps its
  own consecutive experts; the gradients of a gloo world of 2 (EP 2, and 2 replicas of one rank) equal one process's
  on the whole batch, and the trainer's global norm over them too; FSDP2's mixed precision (gathers in the compute
  dtype, reductions in fp32), the head kept gathered into backward, and per micro-batch which collectives run
  (``set_micro_batch``), seen from emulated ranks.
- The emulated process group (``moe_lab.parallel.emulate``): the reductions and exchanges its docstring promises
  that tests/test_emulate.py leaves out, and moving between emulated worlds.
- FLOPs (``moe_lab.metrics.flops``), the trace breakdown (``moe_lab.metrics.trace``), console progress, the runtime
  helpers, validation's refusals and the launcher's rank start-up.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moe_lab import config
from moe_lab.config import ConfigError
from moe_lab.parallel.emulate import enter_world, init_emulated_world, is_emulated
from tests.configs import compose_train
from tests.distributed import run_world


@pytest.fixture(autouse=True)
def no_outer_launcher(monkeypatch):
    """Validation and the launcher read an outer launcher's variables: none here."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def emulated_world():
    """``init_emulated_world`` as a context for the test, the group destroyed afterwards."""
    yield init_emulated_world
    if dist.is_initialized():
        dist.destroy_process_group()


# --- meshes ------------------------------------------------------------------------------------------------------


def expected_groups(rank: int, world: int, ep: int, replicas: int) -> dict:
    """The groups of ``rank`` by the layout's formula, worked out rank by rank: S = world / replicas ranks a replica,
    rank r is shard s = r % S of replica r // S, at (s // ep, s % ep) of its replica's (expert_shard, ep) grid."""
    shard = world // replicas
    replica, s = divmod(rank, shard)
    row, col = divmod(s, ep)
    dense = [[q * shard + i for i in range(shard)] for q in range(replicas)]
    expert_shard = [[q * shard + i * ep + col for i in range(shard // ep)] for q in range(replicas)]
    return {
        "dense": dense if replicas > 1 else dense[0],
        "expert_shard": expert_shard if replicas > 1 else expert_shard[0],
        "ep": [replica * shard + row * ep + j for j in range(ep)],
        "grid": (replica, row, col),
    }


@pytest.mark.parametrize(("world", "ep", "replicas"), [(4, 2, 1), (8, 2, 2), (8, 4, 1)])
def test_every_rank_sits_in_the_groups_the_layout_formula_gives(emulated_world, world, ep, replicas):
    """Dense weights over a replica's consecutive ranks (2-D with the replicas: HSDP's all-reduce across them; 1-D
    without, no replica dimension of one rank), EP groups of consecutive ranks, experts sharded over the ranks of a
    replica that hold the same experts; ``grid_ranks`` (the checkpoint layout) places each rank where the meshes do."""
    from moe_lab.parallel.mesh import build_meshes, grid_ranks

    grid = grid_ranks(world, ep, replicas)
    for rank in range(world):
        emulated_world(rank, world)
        meshes = build_meshes("cpu", ep, replicas)
        want = expected_groups(rank, world, ep, replicas)
        got = {name: getattr(meshes, name).mesh.tolist() for name in ("dense", "expert_shard", "ep")}
        assert got == {k: want[k] for k in got}, rank
        assert meshes.dense.ndim == meshes.expert_shard.ndim == (2 if replicas > 1 else 1)
        assert meshes.world_size == world  # the divide factor of expert gradients: the whole world
        assert grid[want["grid"]].item() == rank


# --- expert parallelism ---------------------------------------------------------------------------------------------


def test_an_ep_rank_keeps_its_own_consecutive_experts_and_says_where_they_start():
    """EP rank 1 of 2 keeps experts 4..7 of each stack (a copy, still trainable) and records its offset, which the
    rows it reports for initialisation and checkpoint loading (``local_rows``) start from."""
    from moe_lab.moe.experts import GroupedExperts
    from moe_lab.parallel.expert_parallel import keep_local_experts
    from moe_lab.parallel.sharding import local_rows

    experts = GroupedExperts(num_experts=8, hidden_size=4, intermediate_size=3)
    whole = {}
    for name, p in experts.named_parameters():
        p.data = torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape)
        whole[name] = p.detach().clone()
    keep_local_experts(experts, ep_rank=1, ep_size=2)
    for name, p in experts.named_parameters():
        assert torch.equal(p.detach(), whole[name][4:8]) and p.requires_grad, name
    assert experts.expert_offset == 4 and experts.num_local_experts == 4
    rows = local_rows(torch.nn.ModuleDict({"experts": experts}))
    assert {name: first for name, (_, first) in rows.items()} == {"experts.gate_up_proj": 4, "experts.down_proj": 4}


# --- gradients across ranks (gloo) -------------------------------------------------------------------------------

LAYOUTS = {  # name: (overrides, the first expert this rank holds, how many)
    "ep2": (["parallel.ep=2"], lambda rank: (4 * rank, 4)),
    "replicas": (["parallel.dp_replicate=2", "parallel.ep=1"], lambda rank: (0, 8)),
}
GRAD_TINY = ["model=tiny", "model.router_balance=none", "trainer.device=cpu", "trainer.precision=fp32"]


def _gradients_against_one_process(layout: str) -> dict:
    """On this rank of a world of 2: the model as the trainer builds it for ``layout``, one backward on this rank's
    share of a batch of 4, against the plain model (same seed) on the whole batch in one process."""
    import torch.nn.functional as F

    from moe_lab.data.synthetic import SyntheticData
    from moe_lab.job.trainer import build_model, clip_grad_norm

    overrides, experts = LAYOUTS[layout]
    rank = dist.get_rank()
    cfg = compose_train(*GRAD_TINY, "trainer.nproc_per_node=2", *overrides)
    options = config.validate(cfg)
    model = build_model(cfg, options, torch.device("cpu"), torch.float32)
    reference = options.model.build()
    reference.init_weights(cfg.trainer.seed)

    def loss_of(m, batch):
        return F.cross_entropy(m(batch.inputs).logits.flatten(0, 1), batch.labels.flatten())

    loss_of(model, SyntheticData(16, 2, cfg.model.vocab_size).batch(0, rank, 2)).backward()
    loss_of(reference, SyntheticData(16, 4, cfg.model.vocab_size).batch(0, 0, 1)).backward()  # the same 4 samples
    first, count = experts(rank)
    differences = {}
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.full_tensor()  # the whole gradient over the parameter's mesh (this EP rank's experts)
        want = ref.grad[first : first + count] if "experts" in name else ref.grad
        differences[name] = ((grad - want).abs().max() / want.abs().max()).item()
    norm = clip_grad_norm(model, math.inf)
    want_norm = torch.stack([p.grad.pow(2).sum() for p in reference.parameters()]).sum().sqrt().item()
    return {"differences": differences, "norm": (norm, want_norm)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_of_two_ranks_are_one_process_gradients_on_the_whole_batch(layout):
    """Each rank's gradients, after FSDP2's reductions, are the one-process model's on both ranks' samples: dense
    gradients averaged over the ranks (and the replicas), expert gradients (which already sum every EP peer's tokens)
    divided by the whole world, also where a shard of one rank skips the reduce-scatter; the trainer's global norm
    sums each element once (over the replica's ranks)."""
    for rank in run_world(2, _gradients_against_one_process, layout):
        worst = max(rank["differences"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst
        assert rank["norm"][0] == pytest.approx(rank["norm"][1], rel=1e-5)


# --- FSDP2 from an emulated rank -------------------------------------------------------------------------------------

RECORDED = ("all_gather_single", "reduce_scatter_single", "all_reduce")


def _tensors(values) -> list[torch.Tensor]:
    return [v for v in values if isinstance(v, torch.Tensor)]


def _recording(log: list, name: str, collective):
    def recording(*args, **kwargs):
        tensors = _tensors(args) + _tensors(kwargs.values())
        dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in tensors)
        log.append((name, dist.get_world_size(kwargs.get("group")), dtypes, tensors[-1].numel()))
        return collective(*args, **kwargs)

    return recording


@pytest.fixture
def collectives(emulated_world, monkeypatch):
    """``build(rank, world, *overrides, dtype)``: the tiny model the trainer builds on an emulated rank; the list
    it returns gets, for each collective FSDP2 issues, (name, group size, its tensors' dtypes, the local input's
    elements), and a ("phase", name) entry for each ``mark(name)``."""
    from moe_lab.job.trainer import build_model

    log: list = []
    for name in RECORDED:
        monkeypatch.setattr(dist, name, _recording(log, name, getattr(dist, name)))

    def build(rank: int, world: int, *overrides: str, dtype=torch.float32):
        emulated_world(rank, world)
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        cfg = compose_train(
            "model=tiny", f"trainer.nproc_per_node={world}", f"trainer.precision={precision}", *overrides
        )
        model = build_model(cfg, config.build_options(cfg), torch.device("cpu"), dtype)
        return model, log

    return build


def phases(log: list) -> dict[str, list]:
    """The collectives logged after each ("phase", name) mark, by phase."""
    by_phase: dict[str, list] = {}
    current = None
    for entry in log:
        if entry[0] == "phase":
            current = by_phase.setdefault(entry[1], [])
        elif current is not None:
            current.append(entry)
    return by_phase


def test_fsdp_gathers_in_the_compute_dtype_and_reduces_gradients_in_fp32(collectives):
    """bf16 compute from fp32 weights (emulated rank 0 of 2): every all-gather moves bf16, every gradient
    reduce-scatter fp32 (the fp32 reduce dtype of the mixed-precision policy), and the gradients stay fp32."""
    model, log = collectives(0, 2, "parallel.ep=1", dtype=torch.bfloat16)
    log.append(("phase", "forward"))
    logits = model(torch.randint(0, 512, (1, 16))).logits
    assert logits.dtype == torch.bfloat16
    log.append(("phase", "backward"))
    logits.float().square().mean().backward()
    seen = phases(log)
    gathers = [e for e in seen["forward"] + seen["backward"] if e[0] == "all_gather_single"]
    reductions = [e for e in seen["backward"] if e[0] == "reduce_scatter_single"]
    assert gathers and all(set(e[2]) == {"bfloat16"} for e in gathers), gathers
    assert len(reductions) == 6 and all(set(e[2]) == {"float32"} for e in reductions), reductions
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


def test_the_head_stays_gathered_from_forward_into_backward(collectives):
    """Final norm + LM head (one FSDP2 group, 512 x 64 + 64 weights: 16,416 a rank of 2 holds) is gathered once in
    forward and not again in backward, which starts with it; the blocks, resharded after forward, are gathered
    again for their backward."""
    model, log = collectives(0, 2, "parallel.ep=1")
    head = (512 * 64 + 64) // 2
    log.append(("phase", "forward"))
    loss = model(torch.randint(0, 512, (1, 16))).logits.square().mean()
    log.append(("phase", "backward"))
    loss.backward()
    seen = phases(log)
    forward = [e[3] for e in seen["forward"] if e[0] == "all_gather_single"]
    backward = [e[3] for e in seen["backward"] if e[0] == "all_gather_single"]
    assert forward.count(head) == 1 and head not in backward
    assert len(backward) >= 4  # each block's dense weights and experts again


def test_each_group_gathers_the_preceding_groups_weights_as_it_starts_backward(collectives):
    """Backward runs head, block 1, block 0, embedding: as each group's backward begins, the next one's gathers are
    issued (a block's dense weights and its experts both), not when autograd reaches that group (emulated rank 0 of
    2, EP 1; the head was kept gathered since forward)."""
    model, log = collectives(0, 2, "parallel.ep=1")
    groups = {"head": model.lm_head, "block 1": model.model.layers[1]}
    groups |= {"block 0": model.model.layers[0], "embedding": model.model.embed_tokens}
    for name, module in groups.items():
        module.register_full_backward_pre_hook(lambda module, grad, name=name: log.append(("phase", name)))
    loss = model(torch.randint(0, 512, (1, 16))).logits.square().mean()
    log.append(("phase", "backward"))
    loss.backward()
    gathered = {phase: sum(e[0] == "all_gather_single" for e in entries) for phase, entries in phases(log).items()}
    assert gathered == {"backward": 0, "head": 2, "block 1": 2, "block 0": 1, "embedding": 0}


MICRO_BATCHES = {  # grad_sync, reshard_after_forward
    "step": ("step", True),
    "micro_batch, kept gathered": ("micro_batch", False),
}


@pytest.mark.parametrize("mode", list(MICRO_BATCHES))
def test_which_collectives_each_micro_batch_runs_with_replicas(collectives, mode):
    """Emulated rank 0 of world 4 as 2 replicas of 2 ranks (EP 1: six FSDP2 groups), two micro-batches set up as
    the trainer does (``set_micro_batch``): grad_sync=step reduces nothing until the final backward;
    grad_sync=micro_batch reduce-scatters in every backward; the replicas' all-reduce runs in the final backward
    only. With reshard_after_forward=false nothing is gathered again after the first forward."""
    from moe_lab.parallel import set_micro_batch

    grad_sync, reshard = MICRO_BATCHES[mode]
    layout = ["parallel.ep=1", "parallel.dp_replicate=2", f"parallel.grad_sync={grad_sync}"]
    model, log = collectives(0, 4, *layout, f"parallel.reshard_after_forward={str(reshard).lower()}")
    tokens = torch.randint(0, 512, (1, 16))
    for micro_batch in (0, 1):
        final = micro_batch == 1
        set_micro_batch(model, final, grad_sync, reshard)
        log.append(("phase", f"forward {micro_batch}"))
        loss = model(tokens).logits.square().mean()
        log.append(("phase", f"backward {micro_batch}"))
        loss.backward()
    counts = {
        phase: {name: sum(e[0] == name and e[1] == 2 for e in entries) for name in RECORDED}
        for phase, entries in phases(log).items()
    }
    groups = 6
    reduce_first = groups if grad_sync == "micro_batch" else 0
    assert counts["backward 0"]["reduce_scatter_single"] == reduce_first
    assert counts["backward 0"]["all_reduce"] == 0
    assert counts["backward 1"]["reduce_scatter_single"] == counts["backward 1"]["all_reduce"] == groups
    assert counts["forward 0"]["all_gather_single"] == groups
    if not reshard:
        assert counts["backward 0"]["all_gather_single"] == counts["forward 1"]["all_gather_single"] == 0


# --- the emulated process group ------------------------------------------------------------------------------------


def test_emulated_reductions_and_exchanges_the_mirror_implies(emulated_world):
    """Rank 1 of 4 whose peers mirror it: a product over 4 equal contributions is the 4th power; a reduce sums at
    its root only; a list reduce-scatter gives this rank's own chunk times 4; an all-to-all delivers from each peer
    the rows this rank sends itself, zeros past them where a receive split asks for more, the first rows where it
    asks for fewer."""
    emulated_world(1, 4)
    x = torch.tensor([1.0, 2.0, 3.0])
    dist.all_reduce(product := x.clone(), op=dist.ReduceOp.PRODUCT)
    assert product.tolist() == (x**4).tolist()
    dist.reduce(at_root := x.clone(), dst=1)
    dist.reduce(elsewhere := x.clone(), dst=0)
    assert at_root.tolist() == (4 * x).tolist() and elsewhere.tolist() == x.tolist()
    out = torch.empty(2)
    dist.reduce_scatter(out, [torch.full((2,), float(peer)) for peer in range(4)])
    assert out.tolist() == [4.0, 4.0]  # chunk 1 from 4 peers
    rows = torch.arange(1.0, 9.0).view(4, 2)  # 1 row to rank 0, 2 to rank 1 (this one), 1 to rank 2, 0 to rank 3
    got = torch.full((9, 2), -1.0)
    dist.all_to_all_single(got, rows, [3, 1, 2, 3], [1, 2, 1, 0])
    own, zero = rows[1:3].tolist(), [0.0, 0.0]
    assert got.tolist() == [*own, zero] + own[:1] + own + [*own, zero]


def test_moving_from_one_emulated_world_to_another_and_out(emulated_world):
    """A sweep's points share one process: an emulated rank of another layout gets a group of its own rank and
    size, and a point that emulates nothing starts without the last point's emulated group."""
    init_emulated_world(0, 2)
    init_emulated_world(1, 4)
    assert (dist.get_rank(), dist.get_world_size(), is_emulated()) == (1, 4, True)
    enter_world({"rank": 3, "world": 4})
    assert (dist.get_rank(), dist.get_world_size()) == (3, 4)
    enter_world(None)
    assert not dist.is_initialized()


def test_summed_over_ranks_sums_every_ranks_share_and_leaves_the_callers_tensor(emulated_world):
    """``summed_over_ranks`` (expert load counts) on rank 0 of 2 mirrored ranks: twice this rank's share, on the
    host, the tensor it was given unchanged (the caller keeps accumulating into it)."""
    from moe_lab.runtime.host_read import summed_over_ranks

    emulated_world(0, 2)
    share = torch.tensor([3.0, 1.0])
    assert summed_over_ranks(share).tolist() == [6.0, 2.0]
    assert share.tolist() == [3.0, 1.0]


# --- FLOPs and MFU ---------------------------------------------------------------------------------------------------


def test_peak_flops_from_the_gpus_name_or_the_override_on_any_device():
    """MFU's denominator: the datasheet's dense bf16 peak of an H100 / H200 (989 TFLOP/s) or B200 (2,250) found by
    a fragment of the name torch reports; none for an unknown GPU; ``trainer.peak_flops`` wins everywhere, on the
    CPU too, where no peak is known otherwise."""
    from moe_lab.metrics.flops import hardware_option, peak_bf16_flops, peak_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989e12)
    assert peak_bf16_flops("NVIDIA H200") == pytest.approx(989e12)
    assert peak_bf16_flops("NVIDIA B200") == pytest.approx(2250e12)
    assert hardware_option("Tesla V100-SXM2-16GB") is None and hardware_option(None) is None
    assert peak_bf16_flops("Tesla V100-SXM2-16GB") is None
    assert peak_flops(torch.device("cpu")) is None
    assert peak_flops(torch.device("cpu"), 4.0e14) == 4.0e14


# --- the trace breakdown ---------------------------------------------------------------------------------------------


def _x(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _launch(ts, correlation):
    return _x("cudaLaunchKernel", ts, 1, cat="cuda_runtime", correlation=correlation)


def _seconds(trace: list[dict]) -> dict:
    from moe_lab.metrics.trace import breakdown

    return {c: round(s * 1e6, 6) for c, s in breakdown(trace)["seconds"].items() if s}


def test_the_compute_stream_is_the_busiest_non_nccl_stream():
    """A long all-gather on its own stream (90 us) does not make its stream the compute stream: the GEMM's stream
    is (20 us busy), and the all-gather counts only where that stream idles."""
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("aten::mm", 10, 2),
        _launch(11, 1),
        _x("nvjet_tst_128x256", 10, 20, cat="kernel", tid=7, stream=7, correlation=1),
        _x("ncclDevKernel_AllGather_RING_LL", 0, 90, cat="kernel", tid=20, stream=20),
    ]
    assert _seconds(events) == {"dense_gemm": 20, "fsdp_all_gather": 70, "idle": 10}


def test_an_inductor_kernel_that_no_op_explains_is_classified_by_its_name():
    """Compiled blocks launch Triton kernels outside any aten op: a sorting or scattering one is the dispatcher's
    glue, any other is ``other``."""
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _launch(1, 1),
        _launch(2, 2),
        _x("triton_poi_fused_index_put_sort_3", 10, 30, cat="kernel", tid=7, stream=7, correlation=1),
        _x("triton_poi_fused_add_mul_0", 40, 20, cat="kernel", tid=7, stream=7, correlation=2),
    ]
    assert _seconds(events) == {"dispatch_glue": 30, "other": 20, "idle": 50}


def test_an_idle_compute_stream_waits_on_a_collective_before_a_copy_or_an_optimizer():
    """Where the compute stream idles under an all-gather, a host -> device copy and an optimizer on another CPU
    thread at once, the collective gets the time; the copy then gets what it alone covers, then the optimizer."""
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("aten::mm", 1, 2),
        _launch(2, 1),
        _x("nvjet_tst_128x256", 0, 10, cat="kernel", tid=7, stream=7, correlation=1),
        _x("ncclDevKernel_AllGather_RING_LL", 10, 30, cat="kernel", tid=20, stream=20),
        _x("Memcpy HtoD (Pinned -> Device)", 10, 50, cat="gpu_memcpy", tid=9, stream=9),
        _x("Optimizer.step#AdamW.step", 10, 70, cat="user_annotation", tid=2),
    ]
    assert _seconds(events) == {"dense_gemm": 10, "fsdp_all_gather": 30, "pcie": 20, "optimizer": 20, "idle": 20}


# --- console progress ------------------------------------------------------------------------------------------------


def test_a_plain_line_comes_when_the_interval_has_passed_exactly(monkeypatch):
    """``every_s`` seconds after the last line, not only later than that."""
    from moe_lab.metrics import progress

    clock = iter([0.0, 30.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    console = progress.ConsoleProgress("train", 10, unit="steps", stream=log, every_s=30.0)
    console.advance()
    console.advance()
    assert log.getvalue().splitlines() == ["train: 1/10 steps", "train: 2/10 steps"]


# --- runtime helpers -------------------------------------------------------------------------------------------------


def test_auto_precision_is_bf16_on_a_gpu_target_only():
    """``trainer.precision=auto`` computes in bf16 where the job runs on a GPU, in fp32 on a CPU target or with
    ``trainer.device=cpu``; bf16 and fp32 are what they say anywhere."""
    from types import SimpleNamespace

    from moe_lab.runtime.device import Target

    def target(device_type):
        return Target(1, 1, device_type, None, None)

    def trainer(device="auto", precision="auto"):
        return SimpleNamespace(device=device, precision=precision)

    assert target("cuda").computes_in_bf16(trainer()) and not target("cpu").computes_in_bf16(trainer())
    assert not target("cuda").computes_in_bf16(trainer(device="cpu"))
    assert target("cpu").computes_in_bf16(trainer(precision="bf16"))
    assert not target("cuda").computes_in_bf16(trainer(precision="fp32"))


def test_a_plain_file_mode_follows_the_umask(tmp_path):
    """0666 less the process's umask, whatever it is: group-writable under 002, group-read-only under 027."""
    from moe_lab.runtime.files import give_plain_file_mode

    path = tmp_path / "record.json"
    path.write_text("{}")
    saved = os.umask(0o002)
    try:
        give_plain_file_mode(path)
        assert path.stat().st_mode & 0o777 == 0o664
        os.umask(0o027)
        give_plain_file_mode(path)
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(saved)


def test_reading_the_umask_on_linux_never_sets_it(tmp_path, monkeypatch):
    """Where /proc shows the umask it is read there: setting it to read it (os.umask) would, for that moment, give
    the files another thread creates (an async checkpoint's writer) mode 0666."""
    from moe_lab.runtime import files

    if not Path("/proc/self/status").is_file():
        pytest.skip("no /proc: the umask is read by setting it")
    path = tmp_path / "record.json"
    path.write_text("{}")
    saved = os.umask(0o027)
    try:
        monkeypatch.setattr(files.os, "umask", lambda mask: pytest.fail(f"os.umask({mask:o}) called"))
        files.give_plain_file_mode(path)
    finally:
        monkeypatch.undo()
        os.umask(saved)
    assert path.stat().st_mode & 0o777 == 0o640


def test_deterministic_mode_seeds_numpys_global_generator_too():
    import numpy as np

    from moe_lab.runtime.determinism import set_determinism

    try:
        set_determinism(True, seed=11)
        drawn = np.random.rand(3)
        set_determinism(True, seed=11)
        assert np.array_equal(np.random.rand(3), drawn)
    finally:
        set_determinism(False, seed=0)


# --- validation ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["profile.enabled=true", "profile.wait=0"], "profile.wait"),
        (["profile.enabled=true", "trainer.steps=2", "profile.wait=1", "profile.warmup=1"], "profile.active"),
        (["optimizer.betas=[0.9,1.0]"], "optimizer.betas"),
        (["trainer.grad_clip=0"], "trainer.grad_clip"),
        (["trainer.checkpoint.keep=0"], "trainer.checkpoint.keep"),
        (["trainer.min_lr_ratio=1.5"], "trainer.min_lr_ratio"),
        (["parallel.emulate=true", "trainer.checkpoint.on_signal=true"], "trainer.checkpoint.on_signal"),
    ],
)
def test_a_value_just_past_its_bound_is_refused_naming_its_key(overrides, key):
    with pytest.raises(ConfigError) as refused:
        config.validate(compose_train(*overrides))
    assert refused.value.key == key


@pytest.mark.parametrize(
    "edge",
    [
        ["profile.enabled=true", "trainer.steps=3", "profile.wait=1", "profile.warmup=1", "profile.active=1"],
        ["trainer.min_lr_ratio=1.0", "trainer.grad_clip=null"],
    ],
)
def test_a_value_at_its_bound_validates(edge):
    """A profile window as long as the run, a schedule that never decays, no clipping."""
    config.validate(compose_train(*edge))


def test_an_outer_launcher_without_a_local_world_size_is_one_node(monkeypatch):
    """Under an outer launcher that gives WORLD_SIZE alone, the job's ranks are one node: EP 4 with 2 replicas of 4
    ranks stays inside it."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    config.validate(compose_train("parallel.dp_replicate=2", "parallel.ep=4"))


# --- the launcher --------------------------------------------------------------------------------------------------


def test_only_a_job_of_several_real_ranks_spawns_them():
    from moe_lab.job.launcher import spawns_ranks

    assert spawns_ranks(compose_train("trainer.nproc_per_node=2"))
    assert not spawns_ranks(compose_train("trainer.nproc_per_node=1"))
    assert not spawns_ranks(compose_train("trainer.nproc_per_node=4", "parallel.emulate=true"))


def test_torchrun_inside_a_slurm_allocation_keeps_torchruns_ranks(monkeypatch):
    """With WORLD_SIZE already set (torchrun started the process inside an srun step), SLURM's task variables are
    not mapped over torchrun's."""
    from moe_lab.job import launcher

    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launcher.adopt_slurm_environment()
    assert {k: os.environ[k] for k in env} == env


def test_rank_0_runs_hydra_as_usual_and_other_ranks_in_a_scratch_directory_of_their_own(monkeypatch, tmp_path):
    from moe_lab.job.launcher import rank_hydra_overrides

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    monkeypatch.setenv("RANK", "0")
    assert rank_hydra_overrides() == []
    monkeypatch.setenv("RANK", "3")
    assert f"hydra.run.dir={tmp_path / 'moe_lab_hydra_rank3'}" in rank_hydra_overrides()


def test_an_emulated_rank_keeps_its_own_run_directory(emulated_world):
    """Emulated rank 1 is the job's one process: its run directory is its own, not a broadcast from a rank 0 that
    does not exist."""
    from moe_lab.job.launcher import shared_run_dir

    emulated_world(1, 2)
    assert shared_run_dir("/runs/point") == "/runs/point"


# --- the experiment logger and activation checkpointing's sets -----------------------------------------------------


class _FakeRun:
    def __init__(self, run_dir, **settings):
        self.settings, self.summary, self.logged, self.exit_code = settings, {}, [], None
        self.dir, self.url = str(run_dir / "wandb" / "offline-run-1" / "files"), "https://wandb.example/run"

    def log(self, row, step):
        self.logged.append((step, row))

    def finish(self, exit_code):
        self.exit_code = exit_code


def test_the_wandb_logger_names_tags_and_finishes_its_run_and_gives_the_environment_back(tmp_path, monkeypatch):
    """With a stand-in for the wandb package: the run is named by the group choices but the logger's own, tagged
    by all of them, grouped by the sweep; its summary holds the trace breakdown's seconds; a failed point finishes
    with exit code 1; the WANDB_* directories it pointed into the run directory are as they were afterwards (set or
    not), so a sweep's next point or the user's shell sees no leftovers."""
    import sys
    from types import SimpleNamespace

    from moe_lab.metrics.logger import WandbLogger

    runs = []

    def init(**settings):
        runs.append(_FakeRun(tmp_path, **settings))
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init, Settings=lambda **kw: kw))
    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    monkeypatch.setenv("WANDB_DATA_DIR", "/users/data")
    logger = WandbLogger()
    choices = {"model": "tiny", "logger": "wandb", "ac": "full"}
    logger.start(tmp_path, {"choices": choices, "sweep": "sweeps/ac", "config": {"trainer": {"steps": 1}}})
    assert os.environ["WANDB_CACHE_DIR"] == str(tmp_path.resolve() / "wandb" / "cache")
    logger.log({"step": 0, "loss": 2.5}, step=0)
    breakdown = {"seconds": {"dense_gemm": 0.25}}
    logger.finish(
        {"status": "error", "metrics": {"trace_breakdown": breakdown}, "error": {"type": "E", "message": "m"}}
    )
    (run,) = runs
    assert run.settings["name"] == "model=tiny-ac=full" and run.settings["group"] == "sweeps/ac"
    assert run.settings["tags"] == ["model=tiny", "logger=wandb", "ac=full"]
    assert run.logged == [(0, {"loss": 2.5})] and run.exit_code == 1
    assert run.summary["time.dense_gemm"] == 0.25 and run.summary["error"] == "E: m"
    assert "WANDB_CACHE_DIR" not in os.environ and os.environ["WANDB_DATA_DIR"] == "/users/data"


def test_selective_ac_keeps_a_declared_op_added_to_a_generic_set():
    """ac.keep's ``matmul`` set keeps torch's matmuls and the ops a precision option declares as matmuls (FP8
    GEMMs); a declared set alone is what its declarer names."""
    from moe_lab.parallel.ac import GENERIC_SETS, kept_ops

    fp8_gemm, route = object(), object()
    kept = kept_ops(["matmul", "router"], {"matmul": frozenset({fp8_gemm}), "router": frozenset({route})})
    assert kept == GENERIC_SETS["matmul"] | {fp8_gemm, route}


def test_selective_ac_offloads_its_activations_once_compiled():
    """ac.offload_activations with ac=selective is refused in eager mode only: compiled, it is accepted."""
    from types import SimpleNamespace

    from moe_lab.parallel.ac import SelectiveCheckpoint

    offloading = SelectiveCheckpoint(offload_activations=True)
    offloading.validate(SimpleNamespace(trainer=SimpleNamespace(compile=True)), None)
    with pytest.raises(ConfigError) as refused:
        offloading.validate(SimpleNamespace(trainer=SimpleNamespace(compile=False)), None)
    assert refused.value.key == "ac.offload_activations"
