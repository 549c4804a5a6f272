"""HSDP (``parallel.dp_replicate``) and FSDP2's ``parallel.reshard_after_forward`` (issue 45).

- Gradients: world 4 as 2 replicas x 2 shards with EP 2, and world 4 as one replica (plain FSDP2) with EP 2, each
  against the unparallelised model with plain AdamW on the whole global batch (tests/test_grad_accum.py's reference):
  per step the loss, the gradient each rank steps with, and the weights after the steps. Then world 2 as 2 replicas
  of one rank (the shard of one, where FSDP2 skips the reduce-scatter) with two micro-batches: grad_sync=step, and
  grad_sync=micro_batch with reshard_after_forward=false, whose replicas' all-reduce still runs once per step.
- Jobs (``python -m moe_lab.train``, in turn in one process): the HSDP layout's losses and clipping norms equal world
  1's; a checkpoint written at R = 2 resumes at R = 1 (world 4) and at world 2, and one written at world 1 resumes
  at R = 2, each continuing the losses (and norms) of the uninterrupted run.
- Emulation: emulated rank 0 of the HSDP layout holds what real rank 0 holds and issues the same collectives, of the
  same sizes on groups of the same sizes (the replicas' all-reduce on a group of 2); an emulated job's record names R.
- Validation names the key; the plan's replica all-reduce and states at world / R.

Tolerance: fp32 throughout, only the summation order differs between layouts: relative 1e-5.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from moe_lab import config
from moe_lab.config import ConfigError
from moe_lab.models.qwen3_moe import Qwen3MoeConfig, count_parameters
from moe_lab.runtime.device import machine_target
from tests.configs import compose_train
from tests.distributed import run_world
from tests.in_turn import run_in_turn
from tests.test_emulate import emulated, one_rank_step
from tests.test_grad_accum import GLOBAL_BATCH, STEPS, build_model, check, max_differences

ROOT = Path(__file__).resolve().parents[1]
HSDP = ["trainer.nproc_per_node=4", "parallel.ep=2", "parallel.dp_replicate=2", "data.batch_size=1"]
FSDP = ["trainer.nproc_per_node=4", "parallel.ep=2", "data.batch_size=1"]


def _layouts_against_one_rank() -> dict:
    from torch.distributed.tensor import Replicate, Shard

    cfg = compose_train(*HSDP, "trainer.device=cpu", "trainer.precision=fp32")
    model = build_model(cfg, config.validate(cfg), torch.device("cpu"), torch.float32)
    dense, experts = model.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].mlp.experts.gate_up_proj
    layout = {
        "dense": (dense.device_mesh.mesh.tolist(), dense.placements == (Replicate(), Shard(0))),
        "experts": (experts.device_mesh.mesh.tolist(), experts.placements == (Replicate(), Shard(0))),
    }
    differences = {"hsdp": max_differences(HSDP), "fsdp": max_differences(FSDP)}
    return {"layout": layout, **differences, "step": one_rank_step("torch", 2, 2)}


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> list:
    """What each rank of a gloo world of 4 gives ``_layouts_against_one_rank`` (one world for two tests)."""
    saved = os.environ.pop("WORLD_SIZE", None)
    try:
        return run_world(4, _layouts_against_one_rank)
    finally:
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved


@pytest.mark.slow  # four gloo ranks
def test_hsdp_trains_like_plain_fsdp_and_one_rank(world4):
    ranks = world4
    # Replicas are consecutive ranks: rank r is shard r % 2 of replica r // 2; experts, EP 2 inside a replica, are
    # sharded over one rank there and replicated across replicas.
    assert ranks[0]["layout"] == {"dense": ([[0, 1], [2, 3]], True), "experts": ([[0], [2]], True)}
    assert ranks[3]["layout"] == {"dense": ([[0, 1], [2, 3]], True), "experts": ([[1], [3]], True)}
    for rank in ranks:
        check(rank["hsdp"] | {"run": "hsdp"})
        check(rank["fsdp"] | {"run": "fsdp"})


ONE_RANK_REPLICAS = ["trainer.nproc_per_node=2", "parallel.dp_replicate=2", "parallel.ep=1", "trainer.grad_accum=2"]
ACCUMULATING = {
    "step": [],
    "micro_batch, kept gathered": ["parallel.grad_sync=micro_batch", "parallel.reshard_after_forward=false"],
}


def _counted(overrides: list[str]) -> tuple[dict, int]:
    """``max_differences`` of a run, and the all-reduces it issued (FSDP2's across the replicas, and the loss's mean
    over ranks once a step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        differences = max_differences(overrides)
    return differences, [e.name for e in prof.events()].count("c10d::allreduce_")


def _one_rank_replicas() -> dict:
    mesh = [*ONE_RANK_REPLICAS, f"data.batch_size={GLOBAL_BATCH // 4}"]
    return {name: _counted(mesh + extra) for name, extra in ACCUMULATING.items()}


@pytest.mark.slow  # two gloo ranks
def test_replicas_of_one_rank_accumulate_like_one_big_batch(monkeypatch):
    """Two replicas of one shard each (the tiny model's six FSDP2 groups: embedding, two blocks, their two expert
    stacks, norm + head), two micro-batches: both grad_sync modes (micro_batch with the blocks kept gathered) train
    like the whole batch, and each group's gradients are all-reduced across the replicas once per step."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    groups = 6
    for rank in run_world(2, _one_rank_replicas):
        for name, (differences, all_reduces) in rank.items():
            check(differences | {"run": name})
            assert all_reduces == STEPS * (groups + 1), name


JOB = [
    "data.seq_len=16",
    "trainer.steps=4",
    "trainer.warmup_steps=1",
    "trainer.grad_clip=0.3",  # below the gradients' norm: the losses depend on the norm's scale
    "trainer.device=cpu",
    "trainer.precision=fp32",
    "trainer.checkpoint.every=2",
]
RUNS = {  # name: (layout, checkpoint it resumes from), in the order they run
    "hsdp": (HSDP, None),
    "world1": (["data.batch_size=4"], None),
    "hsdp_to_fsdp": (FSDP, "hsdp"),  # R = 1 at the same world and EP
    "hsdp_to_world2": (["trainer.nproc_per_node=2", "parallel.ep=2", "data.batch_size=2"], "hsdp"),
    "world1_to_hsdp": (HSDP, "world1"),
}


def _runs(tmp_path: Path) -> dict:
    commands = []
    for name, (layout, resumed) in RUNS.items():
        resume = [f"trainer.resume={tmp_path / resumed / 'checkpoints' / 'step_00000002'}"] if resumed else []
        commands.append([f"hydra.run.dir={tmp_path / name}", *JOB, *layout, *resume])
    output = run_in_turn(commands, cwd=ROOT, timeout=900)
    runs = {}
    for name in RUNS:
        assert (tmp_path / name / "result.json").exists(), output
        record = json.loads((tmp_path / name / "result.json").read_text())
        assert record["status"] == "ok", output
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = {
            "losses": record["metrics"]["losses"],
            "norms": {row["step"]: row["grad_norm"] for row in rows},
            "resumed_from": record["metrics"]["resumed_from"],
        }
    return runs


@pytest.mark.slow  # jobs of 4, 2 and 1 gloo ranks
def test_hsdp_job_clips_like_one_rank_and_resumes_at_any_layout(tmp_path):
    runs = _runs(tmp_path)
    world1 = runs["world1"]
    assert all(norm > 0.3 for norm in world1["norms"].values()), "clipping must be active"
    assert runs["hsdp"]["losses"] == pytest.approx(world1["losses"], rel=1e-5)
    assert runs["hsdp"]["norms"] == pytest.approx(world1["norms"], rel=1e-5)  # the norm clipping used
    for name, (_, resumed) in RUNS.items():
        if resumed is None:
            continue
        run, saved = runs[name], runs[resumed]
        assert run["resumed_from"] == str(tmp_path / resumed / "checkpoints" / "step_00000002"), name
        assert run["losses"][:2] == saved["losses"][:2], name  # the checkpoint's own
        assert run["losses"][2:] == pytest.approx(saved["losses"][2:], rel=1e-5), name  # the uninterrupted run's
        assert run["norms"] == pytest.approx({s: world1["norms"][s] for s in (2, 3)}, rel=1e-5), name


@pytest.mark.slow  # four gloo ranks
def test_emulated_rank_of_hsdp_is_real_rank_0(world4):
    real = world4[0]["step"]
    fake = emulated(0, 4, one_rank_step, "torch", 2, 2)
    assert fake["params"] == real["params"] and fake["buffers"] == real["buffers"]
    assert fake["collectives"] == real["collectives"]
    # FSDP2's all-reduce across the 2 replicas (beside the loss's over all 4 ranks)
    assert ("all_reduce", 2) in {call[:2] for call in real["collectives"]}


def test_emulated_hsdp_record_names_its_replicas(tmp_path):
    from moe_lab.results.table import load
    from tests import cli
    from tests.configs import TINY

    run_dir = tmp_path / "run"
    layout = ["trainer.nproc_per_node=4", "parallel.emulate_nodes=2", "parallel.ep=2", "parallel.dp_replicate=2"]
    proc = cli.train_cli(
        f"hydra.run.dir={run_dir}", *TINY, "trainer.steps=1", "parallel.emulate=true", *layout, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "ok" and record["emulated"]["world"] == 8
    assert record["emulated"]["mesh"] == {
        "nodes": 2,
        "gpus_per_node": 4,
        "dp_replicate": 2,
        "dp_shard": 4,
        "ep": 2,
        "expert_shard": 2,
        "reshard_after_forward": True,
    }
    row = load(run_dir).iloc[0]
    assert row["emulated"] == "rank 0 of 8 (2 x 4, 2 replicas, ep 2)" and row["parallel.dp_replicate"] == 2
    assert record["metrics"]["planned_exposed_comm_by_category_s"]["fsdp_reduce_scatter"] > 0


@pytest.mark.parametrize(
    ("world", "node", "overrides", "key", "message"),
    [
        (4, 4, ["parallel.dp_replicate=3"], "parallel.dp_replicate", "divide the job's 4 ranks"),
        (4, 4, ["parallel.dp_replicate=0"], "parallel.dp_replicate", "must be >= 1"),
        (4, 4, ["parallel.dp_replicate=2", "parallel.ep=4"], "parallel.ep", "divide the 2 ranks of a replica"),
        (16, 4, ["parallel.dp_replicate=2", "parallel.ep=8"], "parallel.ep", "divide a node's 4 ranks"),
        (
            8,
            4,
            [
                "parallel.emulate=true",
                "trainer.nproc_per_node=4",
                "parallel.emulate_nodes=2",
                "parallel.dp_replicate=3",
            ],
            "parallel.dp_replicate",
            "divide the job's 8 ranks (trainer.nproc_per_node or WORLD_SIZE, x parallel.emulate_nodes when emulated)",
        ),
    ],
)
def test_a_bad_mesh_is_refused_naming_its_key(world, node, overrides, key, message):
    with pytest.raises(ConfigError) as error:
        config.validate(compose_train(*overrides), machine_target(world, node))
    assert error.value.key == key and message in str(error.value)


def test_ep_across_nodes_stays_allowed_with_one_replica():
    config.validate(compose_train("parallel.ep=8"), machine_target(16, 4))


PLANNED = ["+experiment=reference_30b", "hardware=h200", "hardware.gpus_per_node=8", "hardware.nodes=2", "ac=full"]


def _plan(*overrides: str) -> dict:
    from moe_lab.plan.config import compose
    from moe_lab.plan.planner import plan

    return plan(compose([*PLANNED, "dispatcher=fused", *overrides]), search=False)


def test_plan_of_replicas():
    """16 H200 as 2 replicas of one node each: the states at world / 2, every FSDP2 collective inside a node, and
    the replicas' all-reduce of each rank's fp32 gradient shard (a ring: twice its bytes, half of them to the other
    replica) on the inter-node links; reshard_after_forward=false keeps the gathered blocks and gathers half as
    often."""
    from moe_lab.plan.config import compose
    from moe_lab.plan.planner import build_hardware, step_of, validated
    from moe_lab.plan.step_time import fsdp_bytes

    one, two = _plan(), _plan("parallel.dp_replicate=2")
    total, _ = count_parameters(Qwen3MoeConfig.preset("qwen3_30b"))
    assert two["plan"]["params_per_gpu"] == pytest.approx(total / 8) == pytest.approx(2 * one["plan"]["params_per_gpu"])
    assert {"dp_replicate": 2, "dp_shard": 8, "replicate_across_nodes": True}.items() <= two["plan"]["mesh"].items()
    assert not two["plan"]["mesh"]["dense_across_nodes"] and one["plan"]["mesh"]["dense_across_nodes"]
    assert two["metrics"]["peak_gpu_mem_gib"] > one["metrics"]["peak_gpu_mem_gib"]

    cfg = compose([*PLANNED, "parallel.dp_replicate=2"])
    hw = build_hardware(cfg.hardware)
    train, options = validated(cfg, hw)
    parts = fsdp_bytes(step_of(train, options, hw))
    assert parts["replicate all_reduce"] == (pytest.approx(2 * 4 * total / 8 / 2), True)
    assert not parts["dense all_gather"][1] and not parts["expert reduce_scatter"][1]

    kept = _plan("parallel.dp_replicate=2", "parallel.reshard_after_forward=false")
    assert kept["metrics"]["peak_gpu_mem_gib"] > two["metrics"]["peak_gpu_mem_gib"]
    assert kept["plan"]["communication_s"]["fsdp_all_gather"] == pytest.approx(
        two["plan"]["communication_s"]["fsdp_all_gather"] / 2
    )


def test_layout_is_a_column_of_every_record_old_ones_too():
    from moe_lab.results.table import flatten

    def row(parallel: dict) -> dict:
        return flatten({"status": "ok", "config": {"parallel": parallel}, "overrides": []}, Path("point"))

    new = row({"dp_replicate": 4, "reshard_after_forward": False})
    assert (new["parallel.dp_replicate"], new["parallel.reshard_after_forward"]) == (4, False)
    old = row({"keep_unsharded": True})  # a record from before the keys: one replica, keep_unsharded's old name
    assert (old["parallel.dp_replicate"], old["parallel.reshard_after_forward"]) == (1, False)
    assert list(new).index("parallel.dp_replicate") < list(new).index("overrides")  # an axis: varying_axes sees it
