"""Issue 30: one process acting as rank r of an N-rank layout (``parallel.emulate``).

Against a real gloo world of 4: emulated rank 0 of world 4 holds exactly the parameter and buffer shapes real rank 0
holds, the fused op's receive buffer has as many rows, and one training step issues the same collectives with the
same sizes (recorded at ``torch.distributed``'s functions, which every caller goes through: FSDP2, the dispatchers,
the trainer). Routing is the forced balanced one, so every rank of the real world routes alike, as the emulated
rank's stand-in peers do. Whole jobs: rank 0 of world 8 and world 32 meshes of the tiny model train in one process
without gloo and record their layout and the planned wire; an emulated world of 1 equals a plain run; a layout the
real run refuses is refused the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import torch.distributed as dist

from moe_lab.config import ConfigError, validate
from moe_lab.parallel.emulate import EmulatedProcessGroup, init_emulated_world
from tests import cli
from tests.distributed import run_world
from tests.interpreted import interpreted
from tests.test_train_cpu import ROOT, result

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "barrier",
)


def compose_train(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from moe_lab.config import register
    from moe_lab.runtime.paths import CONF_DIR

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


@pytest.fixture(autouse=True)
def no_outer_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    return value if isinstance(value, (int, float, bool, type(None))) else type(value).__name__


def _recording(calls: list, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        group = kwargs.get("group")
        options = {k: v for k, v in kwargs.items() if k not in ("group", "async_op")}
        calls.append((name, dist.get_world_size(group), _describe(args), _describe(list(options.items()))))
        return fn(*args, **kwargs)

    return wrapper


def one_rank_step(dispatcher: str, ep: int, dp_replicate: int = 1) -> dict:
    """Build the tiny model on this rank's mesh as the trainer does, run one forward + backward and the loss's
    mean over ranks; -> this rank's parameter and buffer shapes, the fused op's receive rows per layer, and the
    collectives it issued."""
    from moe_lab.job.trainer import mean_over_ranks
    from moe_lab.models.loss import ChunkedLoss
    from moe_lab.models.qwen3_moe import Qwen3MoeConfig
    from moe_lab.moe import dispatcher as dispatchers
    from moe_lab.moe.fused import ops
    from moe_lab.parallel import parallelize
    from moe_lab.parallel.ac import NoCheckpoint
    from moe_lab.parallel.sharding import local_rows, local_shard

    calls, received = [], []
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    reference = ops.BACKENDS["reference"]
    forward = reference.forward

    def recording_forward(*args):
        out = forward(*args)
        received.append(out[1].shape[0])
        return out

    try:
        for name, fn in saved.items():
            setattr(dist, name, _recording(calls, name, fn))
        ops.BACKENDS["reference"] = dataclasses.replace(reference, forward=recording_forward)
        cfg = dataclasses.replace(Qwen3MoeConfig.preset("tiny"), routing="balanced")
        with torch.device("meta"):
            model = cfg.build()
        chosen = dispatchers.TorchDispatcher() if dispatcher == "torch" else dispatchers.FusedDispatcher("reference")
        device = torch.device("cpu")
        parallelize(
            model,
            chosen,
            NoCheckpoint(),
            ep=ep,
            compile=False,
            device=device,
            compute_dtype=torch.float32,
            dp_replicate=dp_replicate,
        )
        model.to_empty(device=device)
        model.init_weights(0, local_rows(model))
        model.init_buffers()
        shapes = {n: tuple(local_shard(p).shape) for n, p in model.named_parameters()}
        buffers = {n: tuple(b.shape) for n, b in model.named_buffers()}
        generator = torch.Generator().manual_seed(dist.get_rank())
        tokens = torch.randint(0, cfg.vocab_size, (1, 17), generator=generator)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:], loss=ChunkedLoss(chunk_tokens=5)).loss
        loss.backward()
        mean_over_ranks(loss.detach(), dist.get_world_size())
        return {"params": shapes, "buffers": buffers, "received": received, "collectives": calls}
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        ops.BACKENDS["reference"] = reference


def emulated(rank: int, world: int, fn, *args):
    init_emulated_world(rank, world)
    try:
        assert isinstance(dist.distributed_c10d._get_default_group(), EmulatedProcessGroup)
        return fn(*args)
    finally:
        dist.destroy_process_group()


def both_dispatchers_step(ep: int) -> dict:
    return {dispatcher: one_rank_step(dispatcher, ep) for dispatcher in ("torch", "fused")}


@pytest.mark.slow  # four gloo processes, each importing torch (about a minute on a shared 2-core machine)
def test_emulated_rank_is_real_rank_0_of_world_4():
    real_world = run_world(4, both_dispatchers_step, 2)[0]
    fake_world = emulated(0, 4, both_dispatchers_step, 2)
    for dispatcher, real in real_world.items():
        fake = fake_world[dispatcher]
        assert fake["params"] == real["params"], dispatcher
        assert fake["buffers"] == real["buffers"], dispatcher
        assert fake["collectives"] == real["collectives"], dispatcher
        names = {c[0] for c in real["collectives"]}
        assert {"all_to_all_single", "all_reduce"} <= names and names & {"all_gather_single", "all_gather_into_tensor"}
        assert names & {"reduce_scatter_single", "reduce_scatter_tensor"}, dispatcher
    assert fake_world["fused"]["received"] == real_world["fused"]["received"]
    assert len(real_world["fused"]["received"]) == 2  # one forward per layer


def test_collectives_mirror_this_rank():
    """Each stand-in peer holds and sends what this rank does (rank 1 of 4)."""

    def check():
        x = torch.arange(4.0)
        dist.all_reduce(y := x.clone())
        assert y.tolist() == (4 * x).tolist()
        dist.all_reduce(y := x.clone(), op=dist.ReduceOp.MAX)
        assert y.tolist() == x.tolist()
        gathered = torch.empty(16)
        dist.all_gather_into_tensor(gathered, x)
        assert gathered.tolist() == x.tolist() * 4
        out = torch.empty(1)
        dist.reduce_scatter_tensor(out, x)
        assert out.tolist() == [4.0]  # chunk 1, from 4 peers
        rows = torch.arange(12.0).view(6, 2)  # 1 row to rank 0, 2 to rank 1 (this one), 3 to rank 2, 0 to rank 3
        got = torch.full((8, 2), -1.0)
        dist.all_to_all_single(got, rows, [2, 2, 2, 2], [1, 2, 3, 0])
        assert got.tolist() == rows[1:3].tolist() * 4  # from every peer: the rows this rank sends itself

    emulated(1, 4, check)


def test_a_scaled_sum_scales_the_world_sum():
    """NCCL's PREMUL_SUM (FSDP2's gradient divide) is ``factor`` times the sum of ``world`` equal contributions, so
    a mean over 4 mirrored peers leaves the tensor as it is (rank 1 of 4)."""

    def check():
        x = torch.arange(4.0)
        dist.all_reduce(y := x.clone(), op=dist._make_nccl_premul_sum(0.25))
        assert y.tolist() == x.tolist()  # 0.25 * 4 * x
        out = torch.empty(1)
        dist.reduce_scatter_tensor(out, x, op=dist._make_nccl_premul_sum(0.5))
        assert out.tolist() == [0.5 * 4 * 1.0]  # chunk 1, from 4 peers, scaled

    emulated(1, 4, check)


def test_the_expert_load_counts_every_ranks_tokens():
    """The logged expert load (each logging step's and the run's) is the global batch's: every rank's counts summed,
    here rank 0 of 2 mirrored, twice its own."""
    from moe_lab.metrics.routing import ExpertLoad

    def check():
        counts = torch.tensor([[3.0, 1.0]])  # one layer, 2 experts, K = 1: 4 tokens on this rank
        stats = torch.cat([counts, torch.tensor([[2.0, 2.0]]), torch.zeros(1, 1)], dim=1)
        load = ExpertLoad(top_k=1, ep=1, every=1, steps=1)
        row = load.add(0, stats, 0.0)
        assert row["expert_load"]["tokens"] == load.summary()["expert_load"]["tokens"] == [[6, 2]]

    emulated(0, 2, check)


def loopback_fused_check(ep: int) -> dict:
    """Rank 0 of an emulated EP group: the gpu backend (Triton kernels, interpreted on CPU) over the group's loopback
    symmetric memory, and the reference backend over its collectives, under balanced and skewed routing."""
    from moe_lab.moe.fused.ops import align
    from tests.fused_cases import backend_pass, bf16_op, received_rows, routing
    from tests.test_fused_kernels import E, H, I, K

    init_emulated_world(0, ep)
    try:
        group = dist.group.WORLD
        gen = torch.Generator().manual_seed(0)
        gate_up_proj = torch.randn(E // ep, 2 * I, H, generator=gen)
        down_proj = torch.randn(E // ep, H, I, generator=gen)
        out = {}
        for kind in ("balanced", "zipf"):
            ids = routing(kind, 0, 16, E, K)
            x, grad_out = torch.randn(16, H, generator=gen), torch.randn(16, H, generator=gen)
            weights = torch.rand(16, K, generator=gen)
            y, residuals, grads = backend_pass("gpu", x, ids, weights, gate_up_proj, down_proj, grad_out, E, group)
            reference = bf16_op(x, ids, weights, gate_up_proj, down_proj, E, group.group_name, "reference")
            out[kind] = {
                "gpu_rows": residuals[0].shape[0],
                "reference_rows": reference[1].shape[0],
                "mirrored_rows": [received_rows([ids] * ep, 0, ep, align(b), E)[1] for b in ("gpu", "reference")],
                "finite": all(bool(t.isfinite().all()) for t in (y, *grads)),
            }
        return out
    finally:
        dist.destroy_process_group()


def test_fused_receive_buffer_holds_the_mirrored_rows():
    """The receive buffer of emulated rank 0 has the rows real rank 0 of a world routing like it receives, in the
    gpu backend (the group's loopback symmetric memory) and the reference backend (its collectives)."""
    for kind, r in interpreted("tests.test_emulate:loopback_fused_check", 4).items():
        assert [r["gpu_rows"], r["reference_rows"]] == r["mirrored_rows"], kind
        assert r["finite"], kind


def _train(*args, multirun: bool = False) -> None:
    """``python -m moe_lab.train`` of a small CPU job (3 steps) with ``args`` after its settings (``-m`` before them:
    Hydra reads no flag after an override), forked from a process that imported it (tests/cli.py); it must exit 0."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    small = ["trainer.device=cpu", "trainer.steps=3", "data.seq_len=32", "data.batch_size=1"]
    proc = cli.train_cli(*(["-m"] if multirun else []), *small, *args, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _job(run_dir, *overrides):
    """One ``_train`` run's record."""
    _train(f"hydra.run.dir={run_dir}", *overrides)
    return result(run_dir)


@pytest.mark.parametrize("layout", [("8", "1", "4"), ("8", "4", "8")], ids=["world8", "world32"])
def test_rank_0_of_large_worlds_trains(tmp_path, layout):
    nproc, nodes, ep = layout
    layout = [f"trainer.nproc_per_node={nproc}", f"parallel.emulate_nodes={nodes}", f"parallel.ep={ep}"]
    record = _job(
        tmp_path,
        "parallel.emulate=true",
        *layout,
        "dispatcher=fused",
        "profile.enabled=true",
        "profile.wait=1",
        "profile.active=1",
    )
    world = int(nproc) * int(nodes)
    assert record["status"] == "ok" and record["world_size"] == world
    assert record["emulated"]["world"] == world and record["emulated"]["rank"] == 0
    assert record["emulated"]["mesh"] == {
        "nodes": int(nodes),
        "gpus_per_node": int(nproc),
        "dp_replicate": 1,
        "dp_shard": world,
        "ep": int(ep),
        "expert_shard": world // int(ep),
        "reshard_after_forward": True,
    }
    assert "not a model's" in record["emulated"]["note"]
    m = record["metrics"]
    assert len(m["losses"]) == 3 and all(map(lambda v: v == v, m["losses"]))
    assert m["s_per_step_measured"] == m["s_per_step"]
    assert m["planned_exposed_comm_s"] == pytest.approx(sum(m["planned_exposed_comm_by_category_s"].values()))
    assert m["planned_exposed_comm_s"] > 0
    assert m["s_per_step_emulated_total"] == pytest.approx(m["s_per_step"] + m["planned_exposed_comm_s"])
    trace = m["trace_breakdown"]
    assert all(trace["seconds"][c] == 0 for c in ("ep_all_to_all", "fsdp_all_gather", "fsdp_reduce_scatter"))
    assert trace["emulated_collectives_s"]["fsdp_all_gather"] > 0 and "collectives at zero" in trace["note"]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3


def test_a_sweep_of_emulated_ranks_trains_each_as_it_trains_alone(tmp_path):
    """A sweep's points share one process: each emulated rank's meshes (and DTensor's cached placements over them)
    are its own, not the point's before (rank 1, run after rank 0, failed its layout check)."""
    layout = ["parallel.emulate=true", "trainer.nproc_per_node=4", "parallel.ep=4"]
    _train(f"hydra.sweep.dir={tmp_path / 'sweep'}", *layout, "parallel.emulate_rank=0,1", multirun=True)
    swept = [result(tmp_path / "sweep" / str(i)) for i in (0, 1)]
    assert [r["status"] for r in swept] == ["ok", "ok"], [r.get("error") for r in swept]
    alone = _job(tmp_path / "alone", *layout, "parallel.emulate_rank=1")
    assert swept[1]["emulated"]["rank"] == 1 and swept[1]["metrics"]["losses"] == alone["metrics"]["losses"]


def test_emulated_world_1_is_a_plain_run(tmp_path):
    plain = _job(tmp_path / "plain")
    emulated_one = _job(tmp_path / "emulated", "parallel.emulate=true")
    assert emulated_one["emulated"]["world"] == 1
    assert emulated_one["metrics"]["losses"] == plain["metrics"]["losses"]


@pytest.mark.parametrize(
    ("nproc", "nodes", "overrides", "key"),
    [
        (8, 4, ["parallel.ep=3"], "parallel.ep"),
        (8, 1, ["parallel.ep=16"], "parallel.ep"),  # the tiny model has 8 experts
    ],
)
def test_a_layout_the_real_run_refuses_is_refused_the_same_way(monkeypatch, nproc, nodes, overrides, key):
    layout = [f"trainer.nproc_per_node={nproc}", f"parallel.emulate_nodes={nodes}"]
    with pytest.raises(ConfigError) as emulated_error:
        validate(compose_train(["parallel.emulate=true", *layout, *overrides]))
    monkeypatch.setenv("WORLD_SIZE", str(nproc * nodes))  # the same layout as real ranks of an outer launcher
    with pytest.raises(ConfigError) as real_error:
        validate(compose_train(overrides))
    assert emulated_error.value.key == real_error.value.key == key
    assert str(emulated_error.value) == str(real_error.value)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["trainer.nproc_per_node=4", "parallel.emulate_rank=4"], "parallel.emulate_rank"),
        (["parallel.emulate_nodes=0"], "parallel.emulate_nodes"),
        (["parallel.emulate_hardware=h300"], "parallel.emulate_hardware"),
        (["trainer.checkpoint.every=2"], "trainer.checkpoint.every"),
    ],
)
def test_emulation_keys_are_validated(overrides, key):
    with pytest.raises(ConfigError) as e:
        validate(compose_train(["parallel.emulate=true", *overrides]))
    assert e.value.key == key


def test_emulation_refuses_an_outer_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ConfigError) as e:
        validate(compose_train(["parallel.emulate=true", "trainer.nproc_per_node=8"]))
    assert e.value.key == "parallel.emulate"


def test_an_emulated_rank_asks_the_host_for_its_whole_node(monkeypatch):
    """Host buffers of an emulated rank are checked as its node's ranks would each take them: 2 GiB fits a host with
    10 GiB free for one process, not for 8 ranks of an emulated node."""
    import moe_lab.optim.offload.host as host

    monkeypatch.setattr(host, "usable_host_bytes", lambda: 10 << 30)
    try:
        host.share_host(1)
        host.check_host_memory(2 << 30, "optimizer state")
        host.share_host(8)
        with pytest.raises(torch.OutOfMemoryError, match="x 8 ranks of the emulated node"):
            host.check_host_memory(2 << 30, "optimizer state")
    finally:
        host.share_host(1)
