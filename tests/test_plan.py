"""The planner (``moe_lab.plan``) against what was measured: the newest grid_30b sitting of every H200 machine folder
(peak memory within 10 %, s/step within 15 %), the offload depth search (deepest proxy per mode), the published
Qwen3-235B reference on B300 (within 20 %); its terms against the code they describe; bad input named by its key.
No model is built and no GPU is used."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from hydra.errors import HydraException

from moe_lab.config import ConfigError
from moe_lab.models.qwen3_moe import Qwen3MoeConfig, count_parameters
from moe_lab.plan.config import compose
from moe_lab.plan.memory import GIB, busiest_rank_share
from moe_lab.plan.planner import build_hardware, plan, step_of, validated
from moe_lab.plan.records import as_made, depth_search_plans, plan_record, read, reference_235b
from tests.sweep import ROOT

GRID = ROOT / "experiments" / "grid_30b" / "records"
# A sitting its study documents as slower than the others (docs/performance.md, "Two GPUs at seq 8192": a fresh
# machine, torchtitan there too 10-23 % slower than in the middle sitting): its points are checked to be slower than
# planned, by less than this.
SLOW_SITTINGS = {"h200_2gpu_seq8192/2026-11-30_09-27": 0.60}


def newest_sittings(records_dir) -> list:
    """The newest sitting (the latest ``<UTC start>`` directory) of each machine folder of a study's records."""
    machines = sorted(p for p in records_dir.iterdir() if p.is_dir())
    return [max(sittings) for m in machines if (sittings := [p for p in m.iterdir() if p.is_dir()])]


def grid_points():
    for sitting in newest_sittings(GRID):
        for result in sorted(sitting.glob("*/result.json")):
            record = read(result)
            if record["status"] == "ok":
                yield pytest.param(
                    record, sitting.relative_to(GRID).as_posix(), id=str(result.parent.relative_to(GRID))
                )


@pytest.mark.parametrize("record, sitting", list(grid_points()))
def test_grid_point_within_tolerance(record, sitting):
    planned = plan_record(record)["metrics"]
    measured = record["metrics"]
    assert planned["peak_gpu_mem_gib"] == pytest.approx(measured["peak_gpu_mem_gib"], rel=0.10)
    if sitting in SLOW_SITTINGS:
        assert planned["s_per_step"] < measured["s_per_step"] < planned["s_per_step"] * (1 + SLOW_SITTINGS[sitting])
    else:
        assert planned["s_per_step"] == pytest.approx(measured["s_per_step"], rel=0.15)


GRID_235B = ROOT / "experiments" / "grid_235b" / "records"


@pytest.mark.parametrize(
    "result", sorted(GRID_235B.glob("*/*/*/result.json")), ids=lambda p: str(p.parent.relative_to(GRID_235B))
)
def test_235b_point_within_tolerance(result):
    """The 235B proxy (2 layers; one GPU so far), a shape the planner was not fitted on: s/step within 15 %. Memory is
    planned high, by 10-16 % in the one-GPU sitting: the plan counts a layer's bf16 weight casts, their bf16
    gradients and its fp32 gradients as present together through its backward, which at this layer's 2.5 B
    parameters (4.6 GiB in bf16) they are not (experiments/plan/README.md); held here to that side, within 20 %."""
    record = read(result)
    assert record["status"] == "ok"
    planned, measured = plan_record(record)["metrics"], record["metrics"]
    assert planned["s_per_step"] == pytest.approx(measured["s_per_step"], rel=0.15)
    assert measured["peak_gpu_mem_gib"] <= planned["peak_gpu_mem_gib"] <= 1.2 * measured["peak_gpu_mem_gib"]


def skewed_points():
    for result in sorted((ROOT / "experiments" / "routing_skew" / "records").glob("*/*/*/result.json")):
        record = read(result)
        if record["status"] == "ok":
            yield pytest.param(record, id=result.parent.relative_to(ROOT / "experiments").as_posix())


@pytest.mark.parametrize("record", list(skewed_points()))
def test_skewed_routing_point_within_tolerance(record):
    """Forced Zipf routing at EP=2 (routing_skew): the busiest rank's rows, drawn by the router's own law, set the
    step. Planned as balanced, these points came out 15-26 % fast for the torch dispatcher; memory is held to 15 %
    here (the torch dispatcher's at Zipf 2.0 is planned 10 % high)."""
    planned, measured = plan_record(record)["metrics"], record["metrics"]
    assert planned["s_per_step"] == pytest.approx(measured["s_per_step"], rel=0.15)
    assert planned["peak_gpu_mem_gib"] == pytest.approx(measured["peak_gpu_mem_gib"], rel=0.15)


def test_busiest_rank_share_follows_the_routing_law():
    assert busiest_rank_share(128, 8, 2.0, 2) > busiest_rank_share(128, 8, 0.5, 2) > 0.5
    assert busiest_rank_share(128, 8, 1.2, 8) > 1 / 8


@pytest.mark.parametrize("record", ["2026-11-30", "2026-12-01_07-58"])  # the x2 host's 252 GiB; the x1 host's 126 GiB
def test_deepest_proxy_per_offload_mode_is_the_measured_one(record):
    depth = read(ROOT / f"experiments/offload_depth/records/h200_1gpu/{record}.json")
    measured = {mode: search["largest_fitting_num_layers"] for mode, search in depth["search"].items()}
    assert depth_search_plans(depth) == measured


def test_published_235b_reference_within_20_percent():
    rows = reference_235b()
    assert {r["reference"] for r in rows} >= {"torchtitan", "torch dispatch", "fused full AC", "fused selective AC"}
    for row in rows:
        if row["compared"]:
            assert row["planned_s"] == pytest.approx(row["published_s"], rel=0.20), row


def test_parameter_counts_match_the_model():
    for option, layers in (("tiny", 2), ("qwen3_30b", 2), ("qwen3_235b", 1)):
        model = Qwen3MoeConfig.preset(option, num_layers=layers)
        cfg = compose([f"model={option}", f"model.num_layers={layers}", "trainer.compile=true"])
        train, options = validated(cfg, build_hardware(cfg.hardware))
        assert step_of(train, options, build_hardware(cfg.hardware)).shapes.total_params == count_parameters(model)[0]


def test_fused_buffers_hold_the_rows_received():
    """At EP=1 and EP=8 the op's buffers hold the rows a rank receives under balanced routing, 131,072 at 16,384
    tokens and top-8, padded per expert (the table of docs/performance.md, "Fused dispatcher memory")."""

    def rows(ep):
        cfg = compose(
            [
                "+experiment=reference_235b",
                "model=qwen3_30b",
                "hardware.gpus_per_node=8",
                f"parallel.ep={ep}",
                "dispatcher=fused",
                "dispatcher.gemm=torch",
            ]
        )
        train, options = validated(cfg, build_hardware(cfg.hardware))
        step = step_of(train, options, build_hardware(cfg.hardware))
        return step.dispatcher.receive_rows(step)

    assert rows(1) == pytest.approx(131_072, rel=0.01) and rows(8) == pytest.approx(131_072, rel=0.01)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (
            ["parallel.ep=3", "model=qwen3_30b", "hardware.gpus_per_node=3"],
            "parallel.ep",
        ),  # 3 does not divide 128 experts
        (
            ["+experiment=reference_235b", "hardware.nodes=1", "hardware.gpus_per_node=4"],
            "parallel.ep",
        ),  # EP 8 on 4 GPUs
        (["hardware.nodes=0"], "hardware.nodes"),
        (
            [
                "+experiment=reference_235b",
                "hardware.nodes=4",
                "hardware.gpus_per_node=8",
                "parallel.ep=16",
                "dispatcher=fused",
            ],
            "parallel.ep",
        ),
        (["hardware=file", "hardware.path=/nonexistent.yaml"], "hardware.path"),
        (["hardware=file"], "hardware.path"),  # left ???: named, not omegaconf's MissingMandatoryValue
        (["trainer.device=cpu"], "trainer.device"),
    ],
)
def test_bad_input_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as error:
        plan(compose(overrides), search=False)
    assert error.value.key == key


def test_unknown_hardware_names_the_group():
    with pytest.raises(HydraException, match="hardware"):
        compose(["hardware=a100"])


def test_cli_sweep_writes_a_plan_record_per_point(tmp_path):
    """``python -m moe_lab.plan -m``: one result.json per point, kind plan, read by moe_lab.results.load; an invalid
    point is recorded with its key."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_lab.plan",
            "-m",
            "model=qwen3_30b",
            "model.num_layers=2",
            "parallel.ep=1,3",
            "hardware.gpus_per_node=2",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / str(i) / "result.json").read_text()) for i in (0, 1)]
    assert [r["kind"] for r in records] == ["plan", "plan"]
    assert [r["status"] for r in records] == ["ok", "invalid"]
    assert records[1]["error"]["key"] == "parallel.ep"
    from moe_lab.results import load

    table = load(tmp_path)
    ok = table[table["status"] == "ok"].iloc[0]
    assert ok["s_per_step"] > 0 and ok["peak_gpu_mem_gib"] > 0 and ok["time.attention"] > 0
    assert list(table["kind"]) == ["plan", "plan"] and ok["plan.fits"] == records[0]["plan"]["fits"]
    assert "largest that fits" in done.stdout + done.stderr


def test_cli_refuses_an_emulated_point_naming_the_key(tmp_path):
    """``parallel.emulate`` describes one rank of a layout the planner takes from ``hardware.*``: refused, recorded
    with its key (its emulate_nodes were not read: a layout train accepts was refused as too small)."""
    done = subprocess.run(
        [sys.executable, "-m", "moe_lab.plan", "model=tiny", "parallel.emulate=true", "parallel.emulate_nodes=2"]
        + [f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1 and "parallel.emulate: the planner plans the whole layout" in done.stderr
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["status"] == "invalid" and record["error"]["key"] == "parallel.emulate"


def test_cli_help_lists_the_hardware_group_beside_trains(tmp_path):
    """``python -m moe_lab.plan --help``: train's page (groups, presets, keys) with plan's usage and the hardware
    group, its default first; nothing written."""
    done = subprocess.run(
        [sys.executable, "-m", "moe_lab.plan", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("moe_lab.plan:")
    hardware = lines.index(next(line for line in lines if line.startswith("hardware: ")))
    options = [line.split()[0] for line in lines[hardware + 1 : hardware + 6]]
    assert options[0] == "h200" and sorted(options) == ["b200", "b300", "file", "h100", "h200"]
    assert "dispatcher: how tokens reach their experts and come back" in lines
    assert any(line.startswith("    grid_30b ") for line in lines)
    assert any(line.startswith("  trainer.steps=") for line in lines)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("split", [False, True])
def test_offload_chunks_replay_the_code(split):
    """The planner's chunks (offload=full's transfer buffers, offload=optimizer's pinned state blocks) are those the
    offload code makes of the model's parameters, in backward order: ``chunked`` (full), or ``chunked_pieces``
    (optimizer: a parameter larger than a chunk cut into pieces of one)."""
    import torch

    from moe_lab.optim.offload.chunked import chunked
    from moe_lab.optim.offload.optimizer import chunked_pieces

    cfg = compose(
        ["model=qwen3_30b", "model.num_layers=2", f"offload={'optimizer' if split else 'full'}", "offload.chunk_mib=64"]
    )
    hw = build_hardware(cfg.hardware)
    train, options = validated(cfg, hw)
    with torch.device("meta"):
        params = list(reversed(list(options.model.build().parameters())))
    limit = 64 * 2**20 // 4
    if split:
        expected = [
            sum(piece.end - piece.start for piece in chunk) for chunk in chunked_pieces(params, limit, split=True)
        ]
    else:
        expected = [sum(p.numel() for p in chunk) for chunk in chunked(params, limit)]
    step = step_of(train, options, hw)
    assert step.offload.chunks(step, reverse=True, split=split) == expected


def test_the_offload_ring_is_max_inflight_of_the_largest_real_chunk():
    """offload=optimizer's device ring is sized as ``OffloadedOptimizer.begin_step`` sizes it: ``max_inflight`` of
    the largest chunk the code makes (at 2048 MiB no parameter is split and the chunks fall short of the limit), not
    of the limit."""
    import torch

    from moe_lab.optim.offload.optimizer import chunked_pieces
    from moe_lab.plan.memory import plan_memory

    cfg = compose(["model=qwen3_30b", "model.num_layers=2", "offload=optimizer", "offload.chunk_mib=2048"])
    cfg.offload.max_inflight = 2
    hw = build_hardware(cfg.hardware)
    train, options = validated(cfg, hw)
    with torch.device("meta"):
        params = list(reversed(list(options.model.build().parameters())))
    limit = 2048 * 2**20 // 4
    largest = max(sum(p.end - p.start for p in chunk) for chunk in chunked_pieces(params, limit, split=True))
    assert largest < 0.96 * limit
    state = plan_memory(step_of(train, options, hw)).categories["optimizer state"]
    assert state == pytest.approx(8 * 2 * largest, rel=1e-9)  # AdamW's two fp32 moments


def test_full_offload_device_share_moves_chunks_from_host_to_device():
    """offload.device_share: the chunks it keeps on the device (the code's choice, whole chunks from the end of
    backward) leave the host step and the host's masters and moments, and add 12 bytes per parameter (fp32 master,
    AdamW's two moments) to the GPU, and a chunk's fp32 gradients at its step."""
    from moe_lab.plan.memory import plan_host, plan_memory
    from moe_lab.plan.step_time import plan_time

    def step(*overrides):
        cfg = compose(["model=qwen3_30b", "model.num_layers=4", "offload=full", *overrides])
        hw = build_hardware(cfg.hardware)
        return step_of(*validated(cfg, hw), hw), hw

    (host_only, hw), (shared, _) = step(), step("offload.device_share=0.5")
    host_chunks, device_chunks = shared.offload.split_chunks(shared)
    on_device = sum(device_chunks)
    assert device_chunks and host_chunks and 0.3 < on_device / (on_device + sum(host_chunks)) <= 0.5
    assert host_only.offload.split_chunks(host_only)[1] == []  # share 0: every chunk on the host
    assert plan_time(shared, hw)["seconds"]["host_step"] == pytest.approx(
        plan_time(host_only, hw)["seconds"]["host_step"] * sum(host_chunks) / (on_device + sum(host_chunks))
    )
    assert sum(plan_host(host_only).values()) - sum(plan_host(shared).values()) >= 12 * on_device
    grown = plan_memory(shared).phases["loss"] - plan_memory(host_only).phases["loss"]
    assert grown * 2**30 == pytest.approx(12 * on_device + 4 * max(device_chunks), rel=1e-6)


def test_offload_rings_are_capped_by_what_the_rank_holds():
    """offload=optimizer's device ring holds ``max_inflight`` chunks' state, but never more than this rank's whole
    state (a ring larger than the model holds what offload=none holds); offload=full's pinned transfer buffers are
    ``max_inflight``, but never more than one per chunk stepped on the host (the code's ``min`` of the two), each the
    largest chunk's bf16 gradients rounded up to a power of two (the experts' gate/up stack: 1 GiB here)."""
    from moe_lab.plan.memory import plan_host, plan_memory

    def step(*overrides):
        cfg = compose(["model=qwen3_30b", "model.num_layers=2", *overrides])
        hw = build_hardware(cfg.hardware)
        return step_of(*validated(cfg, hw), hw)

    def state_gib(*overrides):
        return plan_memory(step(*overrides)).categories["optimizer state"] / GIB

    adamw = 8  # bytes of state per parameter
    total = step().shapes.total_params  # one GPU: this rank holds every parameter
    chunk = 256 * 2**20 / 4  # parameters of a chunk at offload.chunk_mib=256
    assert state_gib("offload=optimizer", "offload.max_inflight=2") == pytest.approx(adamw * 2 * chunk / GIB)
    assert 2 * chunk < total < 1000 * chunk
    assert state_gib("offload=optimizer", "offload.max_inflight=1000") == pytest.approx(adamw * total / GIB)
    assert state_gib("offload=optimizer", "offload.max_inflight=1000") == pytest.approx(state_gib("offload=none"))

    c = step().cfg
    buffer = 2**30
    assert 2 * c.num_experts * 2 * c.moe_intermediate_size * c.hidden_size == buffer * 3 / 4  # bf16 gate/up, rounded up
    full = step("offload=full")
    host_chunks = len(full.offload.split_chunks(full)[0])
    assert host_chunks == 9  # per layer its down and gate/up stacks and the rest; the head, the norm, the embedding
    for inflight, buffers in ((2, 2), (1000, host_chunks)):
        planned = plan_host(step("offload=full", f"offload.max_inflight={inflight}"))["pinned transfer buffers"]
        assert planned == buffers * buffer, inflight


OFFLOAD_ACCUM = ROOT / "experiments" / "offload_accum" / "records" / "h200_1gpu" / "2026-12-01_03-09"
OFFLOAD_ACCUM_NEWEST = OFFLOAD_ACCUM.parent / "2026-12-01_05-44"
# offload=optimizer's device ring at 12, 24 and 36 chunks (8 micro-batches), two sittings of the same code
OFFLOAD_RINGS = [OFFLOAD_ACCUM.parent / "2026-12-01_05-44_ring24", OFFLOAD_ACCUM.parent / "2026-12-01_05-34_ring"]
# offload=full with offload.device_share 0.3 and 0.5 beside none (8 micro-batches)
OFFLOAD_DEVICE_SHARE = OFFLOAD_ACCUM.parent / "2026-12-01_07-46_device_share"


HOST_OPTIMIZER = ROOT / "experiments" / "host_optimizer" / "records" / "h200_host" / "2026-12-01_03-47.json"


def offload_accum_points():
    for sitting in [OFFLOAD_ACCUM_NEWEST, *OFFLOAD_RINGS, OFFLOAD_DEVICE_SHARE]:
        for result in sorted(sitting.glob("*/result.json")):
            record = read(result)
            if record["status"] == "ok":
                yield pytest.param(record, id=str(result.parent.relative_to(OFFLOAD_ACCUM.parent)))


@pytest.mark.parametrize("record", list(offload_accum_points()))
def test_offload_accum_point_within_tolerance(record):
    """offload_accum's newest sitting (every offload mode x grad_accum 1-8, the 16-CPU nvidia-h200 host), its
    offload=optimizer rings of 12-36 chunks and offload=full's device shares, planned with that kind of host's memory
    bandwidth as host_optimizer measured it (its in-place ceiling, 03:47 the same day), against the measured step
    within 15 % and GPU memory within 10 %."""
    ceiling = max(
        row["bytes_per_s"] for row in read(HOST_OPTIMIZER)["rows"] if row["case"] in ("scale_inplace", "add_inplace")
    )
    planned = plan_record(record, [f"hardware.host_memory_gbps={ceiling / 1e9:.1f}"])["metrics"]
    assert planned["s_per_step"] == pytest.approx(record["metrics"]["s_per_step"], rel=0.15)
    assert planned["peak_gpu_mem_gib"] == pytest.approx(record["metrics"]["peak_gpu_mem_gib"], rel=0.10)


# fused + selective AC, 8 micro-batches: offload=optimizer and full; full with device shares 0.3 and 0.5
@pytest.mark.parametrize(
    "point", [OFFLOAD_ACCUM / "1", OFFLOAD_ACCUM / "2", OFFLOAD_DEVICE_SHARE / "0", OFFLOAD_DEVICE_SHARE / "1"]
)
def test_host_memory_of_offload_points(point):
    record = read(point / "result.json")
    planned = plan_record(record)["metrics"]["peak_host_rss_gib"]
    assert planned == pytest.approx(record["metrics"]["peak_host_rss_gib"], rel=0.10)


MOE_LAYER = {
    1: "experiments/moe_layer/records/h200_ep1/2026-12-01_10-56.json",
    2: "experiments/moe_layer/records/h200_ep2/2026-11-30_09-45.json",
}


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_layer_within_tolerance(ep):
    """One MoE layer's forward + backward (experiments/moe_layer/moe_layer.py: the dispatcher and experts alone, 16,384 tokens
    per GPU, balanced routing) against the plan's MoE part of a one-layer step, both shapes, both dispatchers: the
    grouped GEMMs' shape factor, the glue and the exchange, checked where they were not fitted (the 235B shape)."""
    from moe_lab.plan.step_time import moe_seconds

    record = read(ROOT / MOE_LAYER[ep])
    for point in record["points"]:
        if point["routing"] != "balanced" or point["tokens_per_gpu"] != 16384:
            continue
        for dispatcher in ("fused", "torch"):
            cfg = compose(
                [
                    f"model={point['model']}",
                    "model.num_layers=1",
                    "data.seq_len=16384",
                    "data.batch_size=1",
                    f"parallel.ep={ep}",
                    f"hardware.gpus_per_node={ep}",
                    f"dispatcher={dispatcher}",
                    "ac=selective",
                    *as_made({"environment": record}, dispatcher),
                ]
            )
            hw = build_hardware(cfg.hardware)
            train, options = validated(cfg, hw)
            planned = sum(moe_seconds(step_of(train, options, hw), hw).values())
            assert 1e3 * planned == pytest.approx(point[f"{dispatcher}_ms"], rel=0.15), (point["model"], dispatcher)


@pytest.mark.parametrize("ep", [1, 2])
def test_torch_permute_modes_planned_by_their_permutations(ep):
    """dispatcher.permute: the torch dispatcher's permutations, one per layer at EP=1 and three at EP>1, planned in
    ``other`` at copy's 12 bytes an element or select's 32 (each fitted)."""
    from moe_lab.plan.step_time import moe_seconds

    def other(permute):
        cfg = compose(
            [
                "model=qwen3_30b",
                "model.num_layers=2",
                f"parallel.ep={ep}",
                f"hardware.gpus_per_node={ep}",
                "dispatcher=torch",
                f"dispatcher.permute={permute}",
            ]
        )
        hw = build_hardware(cfg.hardware)
        train, options = validated(cfg, hw)
        step = step_of(train, options, hw)
        rows = step.dispatcher.kernel_rows(step) * step.cfg.hidden_size * step.cfg.num_layers
        return moe_seconds(step, hw)["other"], rows / hw.hbm_bytes_per_s

    (copy, per_byte), (select, _) = other("copy"), other("select")
    permutations = 3 if ep > 1 else 1
    assert copy == pytest.approx(12 * permutations * per_byte) and select == pytest.approx(32 * permutations * per_byte)


FULL_DEPTH = ROOT / "experiments" / "full_depth" / "records"


@pytest.mark.parametrize(
    "result",
    sorted(FULL_DEPTH.glob("h200_1gpu_seq*/*/*/result.json"))
    + sorted(FULL_DEPTH.glob("h100_1gpu_20layers_vs_5df4240/*/3139759/*/result.json")),
    ids=lambda p: str(p.parent.relative_to(FULL_DEPTH)),
)
def test_full_depth_point_within_tolerance(result):
    """The 48-layer / 16-expert share at seq 16384 and 32768, every setting of the room issue, and its first 20 layers
    on an H100 (this tree's commit of the regression check): the step within 5 % (the issue's bound) and the peak
    within 3 % (tighter than its 10 %: at 3 % the fused op's output, which compiled selective AC does not keep,
    counted as kept fails the save=inputs points at 32768). A point that ran out of memory was planned not to fit."""
    record = read(result)
    plan = plan_record(record)
    planned, measured = plan["metrics"], record["metrics"]
    if record["status"] == "oom":
        assert not plan["plan"]["fits"], plan["plan"]["fits_why"]
        return
    assert record["status"] == "ok"
    assert planned["s_per_step"] == pytest.approx(measured["s_per_step"], rel=0.05)
    assert planned["peak_gpu_mem_gib"] == pytest.approx(measured["peak_gpu_mem_gib"], rel=0.03)


FP8_E2E = ROOT / "experiments" / "fp8" / "records"


# Records the planner misses by more than the tolerance, each with why; strict, so a planner that learns them fails
# here until its entry goes.
FP8_PLAN_MISSES = {
    # measured after f9cdc23 sped up the weight copies; the FP8 glue was fitted before it (plan 6.9 % high)
    "h200_e2e/2026-12-02_13-03/2": "FP8 glue fitted to the kernels before f9cdc23",
    # FP8 weight gradients by face935's shape rule (today dispatcher.wgrad_precision=fp8), planned as bf16's: their
    # requantization and host reads are not fitted (plan 0.753 s against 0.918 s measured at seq 4096 x 4)
    "h200_e2e_48l16e_seq4096/2026-12-03_15-00/1": "FP8 weight gradients' cost not fitted",
    "h200_e2e_48l16e_seq16384/2026-12-03_15-00/1": "FP8 weight gradients' cost not fitted",
}


def _fp8_point(p):
    name = str(p.parent.relative_to(FP8_E2E))
    reason = FP8_PLAN_MISSES.get(name)
    return (
        pytest.param(p, id=name, marks=pytest.mark.xfail(reason=reason, strict=True))
        if reason
        else pytest.param(p, id=name)
    )


@pytest.mark.parametrize(
    "result",
    [
        _fp8_point(p)
        for p in sorted(FP8_E2E.glob("h200_e2e*/*/*/result.json"))
        if read(p)["config"]["dispatcher"].get("expert_precision") == "fp8"
    ],
)
def test_fp8_point_within_tolerance(result):
    """Every measured FP8 training point (both dispatchers, the 4-layer proxy and full depth, each AC mode): the step
    within 6 % (the records: 3-5.3 % high, the torch dispatcher 4.7 % low) and the peak within 6 % (full AC on the
    4-layer proxy is 5.7 % high, its bf16 twin 5 %; at full depth within 0.1 GiB)."""
    record = read(result)
    assert record["status"] == "ok"
    planned, measured = plan_record(record)["metrics"], record["metrics"]
    assert planned["s_per_step"] == pytest.approx(measured["s_per_step"], rel=0.06)
    assert planned["peak_gpu_mem_gib"] == pytest.approx(measured["peak_gpu_mem_gib"], rel=0.06)


SHARE_TUNE = ROOT / "experiments" / "tune" / "records" / "h200_1gpu_share"
# The share's ac=none point (fp8, save=gate_up, seq 4096 x 4) peaks at 119.7 GiB where the plan says 131.2: planned
# high by 9.6 %, not explained yet; held to that side, within 10 %.
SHARE_MEMORY_PLANNED_HIGH = {"2026-12-04_20-26/measured/2"}


@pytest.mark.parametrize(
    "result", sorted(SHARE_TUNE.glob("**/result.json")), ids=lambda p: str(p.parent.relative_to(SHARE_TUNE))
)
def test_share_tune_point_within_tolerance(result):
    """The full-depth share at seq 4096 x 4 (the tune's measured candidates and the two traced points that
    fp8_dense_gemm_efficiency and attention's short-sequence rate were fitted on): the step within 3 %, the peak
    within 3 % (the one exception above planned high, within 10 %)."""
    record = read(result)
    assert record["status"] == "ok"
    planned, measured = plan_record(record)["metrics"], record["metrics"]
    assert planned["s_per_step"] == pytest.approx(measured["s_per_step"], rel=0.03)
    if str(result.parent.relative_to(SHARE_TUNE)) in SHARE_MEMORY_PLANNED_HIGH:
        assert measured["peak_gpu_mem_gib"] <= planned["peak_gpu_mem_gib"] <= 1.1 * measured["peak_gpu_mem_gib"]
    else:
        assert planned["peak_gpu_mem_gib"] == pytest.approx(measured["peak_gpu_mem_gib"], rel=0.03)


def test_fsdp_reduces_once_a_step_at_grad_sync_step_and_per_micro_batch_otherwise():
    """At 4 micro-batches per step, ``parallel.grad_sync=step`` plans one reduce-scatter of the gradients a step
    (the others accumulate unsharded) and ``micro_batch`` four; the gathers (forward and backward's, every
    micro-batch) are the same either way."""
    from moe_lab.plan.step_time import fsdp_bytes

    def planned(grad_sync):
        cfg = compose(["model=qwen3_30b", "model.num_layers=4", "hardware.gpus_per_node=8", "parallel.ep=2",
                       "trainer.grad_accum=4", f"parallel.grad_sync={grad_sync}"])  # fmt: skip
        hw = build_hardware(cfg.hardware)
        return fsdp_bytes(step_of(*validated(cfg, hw), hw))

    once, every = planned("step"), planned("micro_batch")
    for kind in ("dense", "expert"):
        assert once[f"{kind} reduce_scatter"][0] > 0
        assert every[f"{kind} reduce_scatter"][0] == pytest.approx(4 * once[f"{kind} reduce_scatter"][0])
        assert every[f"{kind} all_gather"] == once[f"{kind} all_gather"]


def hsdp_step():
    """reference_30b on 2 nodes of 8 H200 as 2 replicas of one node each (HSDP): each replica's FSDP2 collectives
    on NVLink, the replicas' all-reduce on the NICs."""
    cfg = compose(["+experiment=reference_30b", "hardware=h200", "hardware.nodes=2", "hardware.gpus_per_node=8",
                   "ac=full", "parallel.dp_replicate=2"])  # fmt: skip
    hw = build_hardware(cfg.hardware)
    return step_of(*validated(cfg, hw), hw), hw


def test_the_last_reduction_under_hsdp_adds_the_embeddings_all_reduce_across_replicas():
    """Compute long enough to hide every block's reductions leaves the step's last one exposed: the embedding's
    gradient reduce-scattered in its replica (fp32, over NVLink) and, with replicas, its shard all-reduced with the
    other replica's (a ring: twice its fp32 bytes, half of them to the other replica, over the NICs)."""
    from moe_lab.plan.step_time import fsdp_exposed

    step, hw = hsdp_step()
    embedding = step.cfg.vocab_size * step.cfg.hidden_size
    assert (step.mesh.shard, step.mesh.dp_replicate, step.mesh.dense_across_nodes) == (8, 2, False)
    reduce_scatter = 4 * embedding * 7 / 8 / hw.link_bytes_per_s(False)
    all_reduce = 2 * 4 * (embedding / 8) * (1 / 2) / hw.link_bytes_per_s(True)
    exposed, _ = fsdp_exposed(step, hw, compute=1e6)
    assert exposed["fsdp_reduce_scatter"] == pytest.approx(reduce_scatter + all_reduce, rel=1e-12)
    one_replica = dataclasses.replace(step, mesh=dataclasses.replace(step.mesh, world=8, dp_replicate=1))
    exposed, _ = fsdp_exposed(one_replica, hw, compute=1e6)  # the same replica alone: its reduce-scatter only
    assert exposed["fsdp_reduce_scatter"] == pytest.approx(reduce_scatter, rel=1e-12)


def test_the_first_gather_waits_for_the_experts_only_where_fsdp_shards_them():
    """Before any compute hides it, the first block's gather: its dense weights and the embedding over the replica's
    8 ranks; its experts only over the ranks that shard them (none at EP 8, half of them at EP 4: 2 ranks)."""
    from moe_lab.plan.step_time import fsdp_exposed

    step, hw = hsdp_step()
    s, link = step.shapes, hw.link_bytes_per_s(False)
    dense = 2 * (s.embedding_params + s.dense_layer_params) * 7 / 8 / link
    for ep, experts in ((8, 0.0), (4, 2 * s.expert_layer_params / 4 * 1 / 2 / link)):
        at_ep = dataclasses.replace(step, mesh=dataclasses.replace(step.mesh, ep=ep))
        assert at_ep.mesh.expert_shard == 8 // ep
        exposed, _ = fsdp_exposed(at_ep, hw, compute=1e6)
        assert exposed["fsdp_all_gather"] == pytest.approx(dense + experts, rel=1e-12)


def test_the_reductions_hide_behind_two_thirds_of_the_compute():
    """Backward (two thirds of a step's compute) hides the reductions queued on the busier link, with half the
    gathers (backward's) beside them: each second of compute hides two thirds of a second of them, until nothing
    but the last reduction is left."""
    from moe_lab.plan.step_time import fsdp_bytes, fsdp_exposed

    step, hw = hsdp_step()
    on_link = {False: 0.0, True: 0.0}
    for kind, (nbytes, across) in fsdp_bytes(step).items():
        on_link[across] += nbytes / hw.link_bytes_per_s(across) * (0.5 if "all_gather" in kind else 1.0)
    backward = max(on_link.values())
    last = fsdp_exposed(step, hw, compute=1e6)[0]["fsdp_reduce_scatter"]
    for share in (0.0, 0.75, 1.2):  # compute in backward's reductions' seconds
        exposed, total = fsdp_exposed(step, hw, compute=share * backward)
        assert exposed["fsdp_reduce_scatter"] == pytest.approx(backward * (1 - share * 2 / 3) + last, rel=1e-9)
        assert exposed["fsdp_reduce_scatter"] < total["fsdp_reduce_scatter"]
    assert fsdp_exposed(step, hw, compute=1.5 * backward)[0]["fsdp_reduce_scatter"] == pytest.approx(last, rel=1e-9)
