"""Same model, different layout (experiments/parity/): every parallelism axis against one reference run, on CPU in
fp32 with the tiny model, compared by ``moe_lab.compare`` step by step.

The reference: one rank, dispatcher=torch, ac=none, offload=none, one micro-batch of the global batch of 4, 4 steps
(a checkpoint at step 2). Each axis changes one thing and keeps the global batch, so the math is the same model's on
the same data. What each axis is held to, and why:

- bit for bit (``--assert-equal``): ac=selective (also with ``ac.keep`` recomputing matmuls and the dispatcher) and
  ac=full (recompute runs the same ops on the same values), the fused op's ``dispatcher.save`` modes against
  save=rows (what is not kept is rebuilt from the same values), and a
  run resumed from the reference's step-2 checkpoint (the whole state, generators included, is restored);
- relative 1e-5 (``--rtol``): where only the order of a sum changes. dispatcher=fused weights each expert row before
  its down projection ((a * w) @ W, not (a @ W) * w); offload=optimizer and offload=full step AdamW on the host over
  flat fp32 chunks in a C kernel (bit for bit here, but within rounding only where its compiler contracts a
  multiply-add differently from torch's kernel); grad_accum=2 adds two half-batch means (with the auxiliary loss
  off: see below); FSDP and EP sum gradients over ranks (reduce-scatter) and EP moves each expert's rows into another
  order. One fp32 rounding (6e-8) per changed sum, carried through 4 AdamW steps (whose normalised update turns a
  gradient's rounding into a relative change of the weight's update): well inside 1e-5 on these losses; the measured
  differences are in experiments/parity/README.md. A bug (a wrong scale, a dropped token, a lost gradient) moves the
  loss by 1e-3 or more within the first steps.
- grad_accum=2 with the auxiliary balance loss on: relative 1e-4. The loss's f_e (each expert's share of the
  routings) is counted over each micro-batch, not over the step's whole batch, so the objective itself changes
  (f_e * P_e of each half, not of the whole); measured 6e-6 here against 8e-8 with the loss off.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_lab import compare, config
from moe_lab.job import lifecycle
from moe_lab.runtime.paths import CONF_DIR
from tests.distributed import run_world

GLOBAL_BATCH = 4
BASE = ["trainer.steps=4", "trainer.warmup_steps=1", "data.seq_len=16", "trainer.device=cpu", "trainer.precision=fp32"]
NO_AUX_LOSS = ["model.router_aux_loss_coef=0"]
AUX_LOSS_PER_MICRO_BATCH = 1e-4  # relative; see the module docstring
CHUNKS = ["offload.chunk_mib=0.05", "offload.max_inflight=2"]  # several chunks, fewer buffers than chunks
SUM_ORDER = 1e-5  # relative; see the module docstring
ONE_RANK = {  # axis: (overrides, bitwise)
    "ac=selective": (["ac=selective"], True),
    "ac=full": (["ac=full"], True),
    "ac=selective ac.keep=[attention,router]": (["ac=selective", "ac.keep=[attention,router]"], True),
    "dispatcher=fused": (["dispatcher=fused"], False),
    "offload=optimizer": (["offload=optimizer", *CHUNKS], False),
    "offload=full": (["offload=full", *CHUNKS], False),
}
GRAD_ACCUM = ["trainer.grad_accum=2", f"data.batch_size={GLOBAL_BATCH // 2}"]
RANKS = {  # world: {axis: overrides} (all to SUM_ORDER)
    2: {
        "fsdp=2": ["parallel.ep=1"],
        "ep=2": ["parallel.ep=2"],
        "ep=2 dispatcher=fused": ["parallel.ep=2", "dispatcher=fused"],
        "ep=2 ac=selective offload=optimizer": ["parallel.ep=2", "ac=selective", "offload=optimizer", *CHUNKS],
    },
    4: {
        "fsdp=4": ["parallel.ep=1"],
        "fsdp=2 ep=2": ["parallel.ep=2"],
        "ep=4 dispatcher=fused": ["parallel.ep=4", "dispatcher=fused"],
    },
}


def train(overrides: list[str], run_dir: Path, world: int = 1) -> Path:
    """One run of the job's own worker in this process (or in each rank of a gloo world): result.json and
    metrics.jsonl in ``run_dir``, as ``python -m moe_lab.train`` leaves them."""
    config.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*BASE, f"data.batch_size={GLOBAL_BATCH // world}", *overrides])
    options = config.validate(cfg)
    record = lifecycle.worker(OmegaConf.to_yaml(cfg, resolve=True), str(run_dir), {"overrides": overrides}, options)
    assert record["status"] == "ok", record.get("error")
    return run_dir


def _train_points(points: list[tuple[list[str], str]], world: int) -> None:
    for overrides, run_dir in points:
        train(overrides, Path(run_dir), world)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return train(["trainer.checkpoint.every=2"], tmp_path_factory.mktemp("parity") / "reference")


def assert_matches(reference: Path, run: Path, bitwise: bool) -> None:
    check = ["--assert-equal"] if bitwise else ["--rtol", str(SUM_ORDER)]
    assert compare.main([str(reference), str(run), *check]) == 0


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.mark.parametrize("axis", list(ONE_RANK))
def test_one_rank_axis_matches_the_reference(axis, reference, tmp_path):
    overrides, bitwise = ONE_RANK[axis]
    assert_matches(reference, train(overrides, tmp_path / "run"), bitwise)


def test_grad_accum_matches_the_reference(reference, tmp_path):
    without_aux_loss = train(NO_AUX_LOSS, tmp_path / "reference_without_aux_loss")
    accumulated = train([*NO_AUX_LOSS, *GRAD_ACCUM], tmp_path / "grad_accum_without_aux_loss")
    assert_matches(without_aux_loss, accumulated, False)
    with_aux_loss = train(GRAD_ACCUM, tmp_path / "grad_accum")
    assert compare.main([str(reference), str(with_aux_loss), "--rtol", str(AUX_LOSS_PER_MICRO_BATCH)]) == 0


def test_resumed_run_matches_the_reference_bit_for_bit(reference, tmp_path):
    """As a run killed after its step-2 checkpoint and started again in its directory: the checkpoint and the
    metrics rows before it are there (rows after it are dropped), training goes on from step 2."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(reference / "checkpoints" / "step_00000002", run_dir / "checkpoints" / "step_00000002")
    shutil.copy(reference / "metrics.jsonl", run_dir / "metrics.jsonl")
    train([], run_dir)
    assert compare.main([str(reference), str(run_dir), "--assert-equal"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_mesh_axes_match_the_reference(world, reference, tmp_path, monkeypatch):
    """One gloo world runs each of its axes in turn (one start-up for all): about a minute each on 2 CPUs."""
    points = [(overrides, str(tmp_path / axis.replace(" ", "_"))) for axis, overrides in RANKS[world].items()]
    run_world(world, _train_points, points, world)
    failed = [
        axis
        for axis, (_, run_dir) in zip(RANKS[world], points)
        if compare.main([str(reference), run_dir, "--rtol", str(SUM_ORDER)]) != 0
    ]
    assert not failed


@pytest.mark.parametrize("save", ["rows_only", "gate_up", "inputs"])
def test_fused_save_modes_match_save_rows_bit_for_bit(save, tmp_path):
    """dispatcher.save keeps less of the fused op for backward and rebuilds the rest from the same values with the
    same ops: its losses are save=rows' to the bit, under ac=none and with ac=selective recomputing the matmuls."""
    for ac in (["ac=none"], ["ac=selective", "ac.keep=[attention,router,dispatcher]"]):
        rows = train(["dispatcher=fused", *ac], tmp_path / f"rows_{ac[0]}")
        assert_matches(
            rows, train(["dispatcher=fused", f"dispatcher.save={save}", *ac], tmp_path / f"{save}_{ac[0]}"), True
        )
