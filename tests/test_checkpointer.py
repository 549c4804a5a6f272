"""Training checkpoints in process (issue 17): complete or absent on disk, pruning, background (async) saves that
resume exactly at world 1 and at world 2 with EP 2, the routers' expert biases (router_balance=bias) saved and
restored (exact resume at world 1 and at world 2 / EP 2; a world-1 checkpoint's restored whole at world 2), a checkpoint of another model refused naming the tensor, and
``trainer.resume`` checked at compose time, ``auto`` refusing a checkpoint of another configuration. The jobs killed and signalled for real are tests/test_resume.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moe_lab import config
from moe_lab.checkpoint import directory as ckpt_dir
from moe_lab.checkpoint.checkpointer import CheckpointDamaged, CheckpointMismatch, Progress, find_damage
from moe_lab.config import ConfigError
from moe_lab.job import lifecycle as job
from moe_lab.job.trainer import build_checkpointer, build_model, train
from moe_lab.moe.router import Router
from tests.distributed import run_world
from tests.test_offload import compose_train

SMALL = ["trainer.steps=6", "trainer.warmup_steps=1", "data.seq_len=16", "data.batch_size=1"]


def train_in_process(overrides: list[str], run_dir) -> dict:
    cfg = compose_train(SMALL + overrides)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return train(cfg, config.validate(cfg), run_dir, torch.device("cpu"), rank, world)


def fake_checkpoint(directory, step: int, marker: bool = True):
    path = ckpt_dir.complete_path(directory, step)
    path.mkdir(parents=True)
    (path / ckpt_dir.DCP_METADATA).write_text("")
    if marker:
        (path / ckpt_dir.MARKER).write_text("{}")
    return path


def test_only_marked_step_directories_are_complete_and_pruning_keeps_the_newest(tmp_path):
    complete = [fake_checkpoint(tmp_path, step) for step in (2, 4, 6)]
    unmarked = fake_checkpoint(tmp_path, 8, marker=False)  # its writer died before marking it
    partial = ckpt_dir.partial_path(tmp_path, 10)
    partial.mkdir()
    assert ckpt_dir.complete(tmp_path) == complete and ckpt_dir.newest(tmp_path) == complete[-1]
    assert ckpt_dir.why_incomplete(unmarked) == f"{ckpt_dir.MARKER} is missing"
    assert "never completed" in ckpt_dir.why_incomplete(partial)
    assert "the newest is" in ckpt_dir.why_incomplete(tmp_path) and str(complete[-1]) in ckpt_dir.why_incomplete(
        tmp_path
    )
    ckpt_dir.prune(tmp_path, keep=2)
    assert ckpt_dir.complete(tmp_path) == complete[1:]
    ckpt_dir.remove_leftovers(tmp_path)
    assert not partial.exists() and unmarked.exists()  # an unmarked step directory is left alone, and never loaded


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.checkpoint.every=-1"], "trainer.checkpoint.every"),
        (["trainer.checkpoint.keep=0"], "trainer.checkpoint.keep"),
        (["trainer.checkpoint.dir=''"], "trainer.checkpoint.dir"),
        (["trainer.resume=/nonexistent/step_00000010"], "trainer.resume"),
        (["+trainer.checkpoint.foo=1"], "trainer.checkpoint.foo"),
    ],
)
def test_bad_checkpoint_settings_fail_naming_their_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        config.validate(compose_train(overrides))
    assert e.value.key == key


def test_resume_names_why_a_path_is_no_checkpoint(tmp_path):
    fake_checkpoint(tmp_path, 4)
    partial = ckpt_dir.partial_path(tmp_path, 6)
    partial.mkdir()
    for path, why in ((partial, "never completed"), (tmp_path, "a directory of checkpoints")):
        with pytest.raises(ConfigError, match=why):
            config.validate(compose_train([f"trainer.resume={path}"]))
    config.validate(compose_train([f"trainer.resume={ckpt_dir.complete_path(tmp_path, 4)}"]))


def test_background_save_resumes_exactly_and_keeps_the_newest(tmp_path):
    every = ["trainer.checkpoint.every=2", "trainer.checkpoint.async_save=true"]
    reference = train_in_process(every, tmp_path / "a")
    assert ckpt_dir.complete(tmp_path / "a" / "checkpoints") == [
        ckpt_dir.complete_path(tmp_path / "a" / "checkpoints", step) for step in (4, 6)
    ]  # keep=2
    resumed_dir = tmp_path / "b"
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000004", resumed_dir / "checkpoints" / "step_00000004")
    resumed = train_in_process(every, resumed_dir)
    assert resumed["losses"] == reference["losses"] and resumed["resumed_from"].endswith("step_00000004")


def test_a_checkpoint_holding_the_lr_schedulers_state_still_loads(tmp_path, monkeypatch):
    """Checkpoints written before the LR schedule was a function of the step hold the scheduler's state: it is never
    read, and the run goes on bit for bit."""
    from moe_lab.checkpoint import checkpointer

    every = ["trainer.checkpoint.every=2"]
    reference = train_in_process(every, tmp_path / "a")
    state_dict = checkpointer.Checkpointer._state_dict

    def with_scheduler_state(self, progress, copy=False):
        old = {"_milestones": [1], "last_epoch": progress.step, "_last_lr": [3e-3] * len(self.optimizer.param_groups)}
        return {**state_dict(self, progress, copy), "scheduler": checkpointer._pickled(old)}

    monkeypatch.setattr(checkpointer.Checkpointer, "_state_dict", with_scheduler_state)
    train_in_process(every, tmp_path / "old")
    monkeypatch.undo()
    old = tmp_path / "old" / "checkpoints" / "step_00000004"
    assert "scheduler" in checkpointer.dcp.FileSystemReader(str(old)).read_metadata().state_dict_metadata
    resumed = train_in_process([*every, f"trainer.resume={old}"], tmp_path / "b")
    assert resumed["losses"] == reference["losses"]


def fp32_weights(overrides: list[str], run_dir, checkpoint) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 weights (its master where the optimizer keeps one apart: offload=full) of a bf16-compute
    model and optimizer built from ``overrides`` and restored from ``checkpoint``."""
    cfg = compose_train(SMALL + ["trainer.precision=bf16", *overrides, f"trainer.resume={checkpoint}"])
    options = config.validate(cfg)
    model = build_model(cfg, options, torch.device("cpu"), torch.bfloat16)
    optimizer = options.offload.build(model, options.make_optimizer, torch.bfloat16)
    build_checkpointer(cfg, options, run_dir, model, optimizer, torch.device("cpu")).restore()
    names = [name for name, _ in model.named_parameters()]
    if not hasattr(optimizer, "master_weights"):  # no master carried on into an optimizer that keeps none
        assert all("master" not in state for state in optimizer.state_dict()["state"].values())
        return {name: w.detach().clone() for name, w in zip(names, model.parameters())}
    return {name: w.clone() for name, w in zip(names, optimizer.master_weights())}


@pytest.mark.parametrize(
    "saved, resumed", [("full", "none"), ("full", "optimizer"), ("none", "full"), ("full", "full")]
)
def test_a_checkpoint_resumes_its_fp32_weights_under_another_offload_mode(saved, resumed, tmp_path):
    """With bf16 compute, offload=full keeps the fp32 weights in its masters (the model's in bf16) and the others in
    the model: a checkpoint of either restores them exactly under the other, and carries no master on (one read
    later by a resume or an export would be the checkpoint's stale weights)."""
    chunks = ["offload.chunk_mib=0.05", "offload.max_inflight=2"]
    every = ["trainer.precision=bf16", "trainer.checkpoint.every=2", "trainer.steps=2", f"offload={saved}"]
    train_in_process(every + (chunks if saved != "none" else []), tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000002"
    expected = fp32_weights([f"offload={saved}"], tmp_path / "e", checkpoint)
    assert any(not torch.equal(w, w.bfloat16().float()) for w in expected.values())  # fp32, not bf16 widened
    got = fp32_weights([f"offload={resumed}"] + (chunks if resumed != "none" else []), tmp_path / "b", checkpoint)
    assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got)


@pytest.mark.parametrize("marker_offload", ["another", "none named"])
def test_a_full_offload_checkpoint_is_read_as_its_marker_says(marker_offload, tmp_path):
    """offload=full's checkpoint (bf16 model tensors beside fp32 masters) read under every mode, as its marker says:
    one naming another offload mode is read through its model tensors, whatever masters it holds (before 2026-12-07 a
    run of another mode resumed from offload=full's checkpoint carried its masters on, stale, into its own); one
    naming no offload mode (written before the option existed) through its fp32 masters."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    chunks = ["offload.chunk_mib=0.05", "offload.max_inflight=2"]
    train_in_process(
        ["trainer.precision=bf16", "trainer.checkpoint.every=2", "trainer.steps=2", "offload=full", *chunks],
        tmp_path / "a",
    )
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000002"
    marker_file = checkpoint / ckpt_dir.MARKER
    marker = json.loads(marker_file.read_text())
    if marker_offload == "another":
        marker["config"]["offload"] = {"_target_": "moe_lab.optim.offload.NoOffload"}  # as the old resumed run wrote it
    else:
        del marker["config"]["offload"]
    marker_file.write_text(json.dumps(marker))
    dcp_to_torch_save(checkpoint, tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    weights = {key.removeprefix("model/"): value.float() for key, value in saved.items() if key.startswith("model/")}
    masters = {name: saved[f"optimizer/{name}/master"] for name in weights}
    assert any(not torch.equal(w, masters[n]) for n, w in weights.items())  # bf16 vs fp32
    expected = weights if marker_offload == "another" else masters
    for resumed in (["offload=none"], ["offload=full", *chunks]):
        got = fp32_weights(resumed, tmp_path / resumed[0], checkpoint)
        assert got.keys() == expected.keys() and all(torch.equal(got[n], expected[n]) for n in got), resumed


def checkpointer_of(run_dir, overrides: list[str] = ()):
    """A checkpointer of a fresh tiny model and its optimizer (fp32, nothing trained), writing under ``run_dir``."""
    cfg = compose_train([*SMALL, "trainer.checkpoint.every=2", *overrides])
    options = config.validate(cfg)
    model = build_model(cfg, options, torch.device("cpu"), torch.float32)
    optimizer = options.offload.build(model, options.make_optimizer, torch.float32)
    return build_checkpointer(cfg, options, run_dir, model, optimizer, torch.device("cpu")), model


def test_saving_a_step_already_on_disk_leaves_it_as_it_is(tmp_path):
    """A run resumed from step 2 saves step 2 again at once: the complete checkpoint there is kept, file for file,
    nothing is written (no partial directory) and the save returns where it is."""
    checkpointer, model = checkpointer_of(tmp_path)
    first = checkpointer.save(Progress(2, [1.0, 0.5]))
    files = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in first.iterdir()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # what a second write would hold
    assert checkpointer.save(Progress(2, [1.0, 0.5])) == first
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in first.iterdir()} == files
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]


def test_the_disk_space_check_counts_every_ranks_bytes(tmp_path, monkeypatch):
    """Every rank writes into the one directory: the space a checkpoint needs is the sum of every rank's tensor
    bytes (here another rank's petabyte, which no disk holds) plus the headroom, not this rank's alone."""
    from moe_lab.checkpoint import checkpointer as module

    ours = []

    def gathered(value):
        ours.append(value)
        return [value, 10**15]

    monkeypatch.setattr(module, "_gathered", gathered)
    checkpointer, _ = checkpointer_of(tmp_path)
    with pytest.raises(module.NotEnoughDiskSpace) as failed:
        checkpointer.save(Progress(2, [1.0, 0.5]))
    assert ours and ours[0] > 0
    assert f"it needs {ours[0] + 10**15 + module.DISK_HEADROOM:,} bytes" in str(failed.value)
    assert ckpt_dir.complete(tmp_path / "checkpoints") == []


def _dtensor_bytes_world2() -> list[int]:
    """``state_bytes`` on this rank of DTensors placed as the checkpoint's are: replicated over a 1-D mesh, sharded
    over it, and HSDP's (Replicate, Shard(0)) over a (2 replicas, 1 shard) and a (1 replica, 2 shards) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from moe_lab.checkpoint.checkpointer import state_bytes

    flat = init_device_mesh("cpu", (2,))
    replicas, shards = (init_device_mesh("cpu", shape, mesh_dim_names=("r", "s")) for shape in ((2, 1), (1, 2)))
    hsdp = [Replicate(), Shard(0)]
    states = [
        {"w": distribute_tensor(torch.ones(6, 4), flat, [Replicate()])},
        {"w": distribute_tensor(torch.ones(8, 4, dtype=torch.bfloat16), flat, [Shard(0)])},
        {"w": distribute_tensor(torch.ones(10, 4), replicas, hsdp)},
        {"w": distribute_tensor(torch.ones(10, 4), shards, hsdp)},
    ]
    return [state_bytes(state) for state in states]


def test_the_disk_space_check_counts_a_replicated_dtensor_once_over_its_replicas():
    """DCP writes a replicated piece once (HSDP's replicas hold the same one): summed over the ranks, a DTensor's
    bytes are those of the whole tensor, whether it is replicated, sharded or both; not once per replica."""
    per_rank = run_world(2, _dtensor_bytes_world2)
    whole = [6 * 4 * 4, 8 * 4 * 2, 10 * 4 * 4, 10 * 4 * 4]  # fp32, bf16, fp32, fp32
    assert [sum(case) for case in zip(*per_rank)] == whole
    assert per_rank[0] == per_rank[1]  # each rank counts an equal share


# Aux-loss-free balancing at a rate that moves the choice of experts within a step or two: a resumed run whose
# routers forgot their biases routes (and so trains) differently.
EXPERT_BIAS = ["model.router_balance=bias", "model.router_bias_update_rate=0.05"]


def test_expert_bias_is_saved_and_resumes_exactly(tmp_path):
    every = [*EXPERT_BIAS, "trainer.checkpoint.every=2"]
    reference = train_in_process(every, tmp_path / "a")
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000004"
    resumed = train_in_process([*every, f"trainer.resume={checkpoint}"], tmp_path / "b")
    assert resumed["losses"] == reference["losses"]
    bias = "buffer/model\\.layers\\.0\\.mlp\\.gate\\.expert_bias"
    with pytest.raises(CheckpointMismatch, match=f"{bias} is a buffer this model lacks"):
        train_in_process([f"trainer.resume={checkpoint}"], tmp_path / "c")  # router_balance=aux_loss
    train_in_process(["trainer.steps=1", "trainer.checkpoint.every=1"], tmp_path / "d")
    with pytest.raises(CheckpointMismatch, match=f"no {bias}"):
        train_in_process([*every, f"trainer.resume={tmp_path / 'd' / 'checkpoints' / 'step_00000001'}"], tmp_path / "e")


def restored_expert_biases(overrides: list[str], run_dir) -> list[list[float]]:
    """Each router's expert_bias after restoring the checkpoint ``trainer.resume`` names, on this rank."""
    cfg = compose_train(SMALL + EXPERT_BIAS + overrides)
    options = config.validate(cfg)
    model = build_model(cfg, options, torch.device("cpu"), torch.float32)
    optimizer = options.offload.build(model, options.make_optimizer, torch.float32)
    build_checkpointer(cfg, options, run_dir, model, optimizer, torch.device("cpu")).restore()
    return [m.expert_bias.tolist() for m in model.modules() if isinstance(m, Router)]


def _restored_expert_biases_world2(checkpoint: str, run_dir: str) -> list[list[float]]:
    return restored_expert_biases(
        ["trainer.nproc_per_node=2", "parallel.ep=2", f"trainer.resume={checkpoint}"], run_dir
    )


@pytest.mark.slow
def test_expert_bias_written_at_world1_restores_whole_at_world2_ep2(tmp_path, monkeypatch):
    """The biases are not sharded: a checkpoint of one rank gives both ranks of an EP 2 mesh the same, whole ones."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    train_in_process([*EXPERT_BIAS, "trainer.steps=3", "trainer.checkpoint.every=3"], tmp_path / "a")
    checkpoint = str(tmp_path / "a" / "checkpoints" / "step_00000003")
    saved = restored_expert_biases([f"trainer.resume={checkpoint}"], tmp_path / "b")
    assert all(any(b != 0 for b in layer) for layer in saved)  # three updates moved every layer's biases
    assert run_world(2, _restored_expert_biases_world2, checkpoint, str(tmp_path / "c")) == [saved, saved]


def _background_save_world2(run_dir: str) -> list[float]:
    every = [
        "trainer.nproc_per_node=2",
        "parallel.ep=2",
        "offload=full",
        "trainer.checkpoint.every=3",
        "trainer.checkpoint.async_save=true",
        "trainer.checkpoint.keep=null",
        *EXPERT_BIAS,
    ]
    reference = train_in_process(every, f"{run_dir}/a")
    resumed = train_in_process([*every, f"trainer.resume={run_dir}/a/checkpoints/step_00000003"], f"{run_dir}/b")
    return [reference["losses"], resumed["losses"]]


@pytest.mark.slow
def test_background_save_at_world2_ep2_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for reference, resumed in run_world(2, _background_save_world2, str(tmp_path)):
        assert resumed == reference and len(reference) == 6


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    train_in_process(
        ["trainer.steps=1", "trainer.checkpoint.every=1", "model.moe_intermediate_size=16"], tmp_path / "a"
    )
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000001"
    with pytest.raises(
        CheckpointMismatch,
        match=r"model/model\.layers\.0\.mlp\.experts\.gate_up_proj has shape \(8, 32, 64\), this model's is \(8, 64, 64\)",
    ):
        train_in_process([f"trainer.resume={checkpoint}"], tmp_path / "b")


def test_auto_resume_refuses_a_checkpoint_of_another_configuration(tmp_path):
    """A killed run leaves checkpoints and no record: the next job into its directory with another configuration
    stops naming the checkpoint instead of continuing from it (checkpoint settings are no part of the point)."""
    cfg = compose_train(SMALL)
    checkpoint = fake_checkpoint(tmp_path / "checkpoints", 4)
    (checkpoint / ckpt_dir.MARKER).write_text(
        json.dumps({"config": job.point_config(compose_train([*SMALL, "ac=full"]))})
    )
    with pytest.raises(job.RunDirInUse, match=f"{checkpoint} is a checkpoint of another configuration"):
        job.earlier_record(tmp_path, cfg, multirun=True)
    (checkpoint / ckpt_dir.MARKER).write_text(
        json.dumps({"config": job.point_config(compose_train([*SMALL, "trainer.checkpoint.every=2"]))})
    )
    assert job.earlier_record(tmp_path, cfg, multirun=True) is None  # the same point: it resumes
    job.earlier_record(tmp_path, compose_train([*SMALL, "ac=full", "trainer.resume=never"]), multirun=True)


def _damage(checkpoint, how: str) -> str:
    """Cut short, delete or overwrite (zeros, its size kept: found only when read) the checkpoint's data file; its
    name."""
    data = next(checkpoint.glob("*.distcp"))
    if how == "truncated":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif how == "deleted":
        data.unlink()
    else:
        data.write_bytes(bytes(data.stat().st_size))
    return data.name


@pytest.mark.parametrize("how", ["truncated", "deleted", "overwritten"])
def test_a_damaged_checkpoint_falls_back_to_the_one_before_or_fails_naming_it(how, tmp_path):
    """The newest checkpoint's data file cut short or gone: ``trainer.resume=auto`` sets it aside and resumes from
    the complete one before it, bit for bit (the default, trainer.resume_fallback=true); with the fallback off the
    run fails naming the checkpoint and the file, and so it does when no checkpoint is left to fall back to."""
    every = ["trainer.steps=4", "trainer.checkpoint.every=2"]
    reference = train_in_process(every, tmp_path / "a")
    directory = tmp_path / "a" / "checkpoints"
    newest, before = ckpt_dir.complete_path(directory, 4), ckpt_dir.complete_path(directory, 2)
    file = _damage(newest, how)

    what = {"truncated": "cut short: ", "deleted": "missing", "overwritten": "reading it failed: rank 0: "}[how]
    with pytest.raises(
        CheckpointDamaged,
        match=f"checkpoint {newest} is damaged: {file}: {what}.*"
        f"trainer.resume_fallback=true would set it aside and continue from {before}",
    ) as e:
        train_in_process([*every, "trainer.resume_fallback=false"], tmp_path / "a")
    assert e.value.details == {"checkpoint": str(newest), "file": file}
    assert ckpt_dir.complete(directory) == [before, newest]  # left as it was

    resumed = train_in_process(every, tmp_path / "a")
    assert resumed["resumed_from"] == str(before) and resumed["losses"] == reference["losses"]
    assert [d["checkpoint"] for d in resumed["damaged_checkpoints"]] == [str(newest)]
    assert resumed["damaged_checkpoints"][0]["file"] == file
    assert (directory / "step_00000004.damaged").is_dir()  # set aside for a look; step 4 was written afresh
    assert ckpt_dir.complete(directory) == [before, newest] and find_damage(newest) is None

    _damage(newest, how)
    _damage(before, how)
    with pytest.raises(
        CheckpointDamaged, match=f"checkpoint {before} is damaged: {file}: .*no complete checkpoint before it"
    ):
        train_in_process(every, tmp_path / "a")
    with pytest.raises(CheckpointDamaged, match=f"checkpoint {before} is damaged.*named by trainer.resume"):
        train_in_process([*every, f"trainer.resume={before}"], tmp_path / "b")


def test_a_checkpoint_of_another_depth_is_refused_naming_the_tensor(tmp_path):
    """A tensor of the checkpoint the model lacks, or one of the model the checkpoint lacks, is refused (with an
    optimizer that keeps no per-parameter state, the model's tensors are all that differ)."""
    one_step = ["trainer.steps=1", "trainer.checkpoint.every=1", "optimizer=signsgd"]
    train_in_process(one_step, tmp_path / "two")
    train_in_process([*one_step, "model.num_layers=1"], tmp_path / "one")
    two, one = (tmp_path / name / "checkpoints" / "step_00000001" for name in ("two", "one"))
    with pytest.raises(
        CheckpointMismatch,
        match=r"model/model\.layers\.1\.\S+ \(and \d+ more\) is the state of a parameter this model lacks",
    ):
        train_in_process([*one_step, "model.num_layers=1", f"trainer.resume={two}"], tmp_path / "c")
    with pytest.raises(CheckpointMismatch, match=r"no model/model\.layers\.1\."):
        train_in_process([*one_step, f"trainer.resume={one}"], tmp_path / "d")
    train_in_process(["trainer.steps=1", "trainer.checkpoint.every=1"], tmp_path / "adamw")  # per-parameter state
    adamw = tmp_path / "adamw" / "checkpoints" / "step_00000001"
    with pytest.raises(
        CheckpointMismatch, match=r"model\.layers\.1\.\S+ \(and \d+ more\) is the state of a parameter this model lacks"
    ):
        train_in_process(["trainer.steps=2", "model.num_layers=1", f"trainer.resume={adamw}"], tmp_path / "e")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_the_disk_cannot_hold_fails_naming_directory_and_bytes(tmp_path, monkeypatch, async_save):
    """Free space runs out after the step-2 checkpoint: the step-4 save fails before writing anything, naming the
    directory, the bytes it needs and those free; the step-2 checkpoint stays complete and the run's record says
    why."""
    from omegaconf import OmegaConf

    from moe_lab.checkpoint import checkpointer

    real = shutil.disk_usage
    calls = []

    def disk_usage(path):
        calls.append(path)
        usage = real(path)
        return usage._replace(free=usage.free if len(calls) == 1 else 1000)

    monkeypatch.setattr(checkpointer.shutil, "disk_usage", disk_usage)
    background = f"trainer.checkpoint.async_save={str(async_save).lower()}"
    cfg = compose_train([*SMALL, "trainer.checkpoint.every=2", background])
    run_dir = tmp_path / "run"
    with pytest.raises(checkpointer.NotEnoughDiskSpace) as failed:
        job.worker(OmegaConf.to_yaml(cfg, resolve=True), str(run_dir), {})
    directory = run_dir / "checkpoints"
    needed = int(str(failed.value).split(" needs ")[1].split(" bytes")[0].replace(",", ""))
    assert f"checkpoint step_00000004 in {directory}: it needs {needed:,} bytes" in str(failed.value)
    assert "the file system has 1,000 bytes" in str(failed.value)
    # The tensors' bytes: at least the fp32 weights and AdamW's two moments.
    model = build_model(cfg, config.validate(cfg), torch.device("cpu"), torch.float32)
    params = sum(p.numel() for p in model.parameters())
    assert needed >= 3 * 4 * params + checkpointer.DISK_HEADROOM
    assert ckpt_dir.complete(directory) == [ckpt_dir.complete_path(directory, 2)]
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000002"]  # nothing of step 4 written
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "error" and record["error"]["type"] == "NotEnoughDiskSpace"
    assert str(directory) in record["error"]["message"]
