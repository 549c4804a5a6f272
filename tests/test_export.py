"""``python -m moe_lab.export`` (issue 17): a training checkpoint becomes a sharded Hugging Face checkpoint that
transformers' Qwen3MoeForCausalLM loads with the logits of the trained model, as the trainer restores it from the
same checkpoint (fp32: 1e-5, as tests/test_hf_parity.py); offload=full's fp32 masters are what it exports. A
checkpoint of EP 2 ranks exports its experts in global order, and EP 2 ranks load them back from either layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from moe_lab import config
from moe_lab.checkpoint import directory as ckpt_dir
from moe_lab.checkpoint.checkpointer import Checkpointer, Progress
from moe_lab.export import export
from moe_lab.export import main as export_main
from moe_lab.job.trainer import build_model
from moe_lab.models.hf_weights import INDEX, SINGLE, CheckpointReader, load_hf_checkpoint
from moe_lab.moe.experts import GroupedExperts
from moe_lab.parallel.sharding import local_shard
from tests.distributed import run_world
from tests.test_checkpointer import SMALL, checkpointer_of, train_in_process
from tests.test_offload import compose_train

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def export_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-m", "moe_lab.export", *map(str, args)], env=env, capture_output=True, text=True, timeout=300
    )


def restored_model(overrides: list[str], checkpoint: Path) -> torch.nn.Module:
    """The model as a run resuming from ``checkpoint`` starts."""
    cfg = compose_train(overrides)
    options = config.validate(cfg)
    device = torch.device("cpu")
    model = build_model(cfg, options, device, torch.float32)
    optimizer = options.offload.build(model, options.make_optimizer, torch.float32)
    Checkpointer(
        cfg.trainer.checkpoint,
        str(checkpoint),
        "unused",
        fallback=False,
        model=model,
        optimizer=optimizer,
        data=options.data,
        device=device,
        state_device=device,
        config={},
        model_config={},
    ).restore()
    return model.eval()


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_trained_logits(tmp_path):
    overrides = [
        "trainer.steps=2",
        "trainer.warmup_steps=1",
        "data.seq_len=16",
        "data.batch_size=1",
        "trainer.checkpoint.every=2",
    ]
    train_in_process(overrides, tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    proc = export_cli(checkpoint, tmp_path / "hf", "--max-shard-size", "200KB")
    assert proc.returncode == 0, proc.stderr[-3000:]

    weight_map = json.loads((tmp_path / "hf" / INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and "model.layers.1.mlp.experts.7.down_proj.weight" in weight_map
    assert all(os.path.getsize(tmp_path / "hf" / f) <= 200_000 + 4096 for f in set(weight_map.values()))  # + header
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = restored_model(overrides, checkpoint)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_export_of_full_offload_in_bf16_holds_the_fp32_masters(tmp_path):
    overrides = [
        "trainer.steps=1",
        "data.seq_len=16",
        "data.batch_size=1",
        "trainer.checkpoint.every=1",
        "offload=full",
        "trainer.precision=bf16",
    ]
    train_in_process(overrides, tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert export_cli(checkpoint, tmp_path / "hf", "--max-shard-size", "100MB").returncode == 0
    name = "model.layers.0.self_attn.q_proj.weight"
    saved = {
        f"model/{name}": torch.empty(64, 64, dtype=torch.bfloat16),
        f"optimizer/{name}/master": torch.empty(64, 64),
    }
    dcp.load(
        saved, checkpoint_id=str(checkpoint), planner=dcp.DefaultLoadPlanner(flatten_state_dict=False), no_dist=True
    )
    exported = CheckpointReader(tmp_path / "hf").get(name, (64, 64), torch.float32)
    assert exported.dtype == torch.float32 and torch.equal(exported, saved[f"optimizer/{name}/master"])
    assert not torch.equal(exported, saved[f"model/{name}"].float())  # the bf16 weights are the masters rounded
    # Masters in a checkpoint of another offload mode (carried on, stale, by a cross-mode resume before 2026-12-07)
    # are not its weights: the model tensors are exported.
    marker_file = checkpoint / ckpt_dir.MARKER
    marker = json.loads(marker_file.read_text())
    marker["config"]["offload"] = {"_target_": "moe_lab.optim.offload.NoOffload"}
    marker_file.write_text(json.dumps(marker))
    assert export_cli(checkpoint, tmp_path / "hf_none", "--max-shard-size", "100MB").returncode == 0
    exported = CheckpointReader(tmp_path / "hf_none").get(name, (64, 64), torch.float32)
    assert torch.equal(exported, saved[f"model/{name}"].float())


EP2 = ["trainer.nproc_per_node=2", "parallel.ep=2"]


def _local_expert_stacks(model: torch.nn.Module) -> dict[str, tuple[int, object]]:
    """This rank's expert stacks by parameter name: (the global index of its first expert, the local stack)."""
    return {
        f"{module_name}.{kind}": (module.expert_offset, local_shard(param).detach().numpy().copy())
        for module_name, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for kind, param in module.named_parameters(recurse=False)
    }


def _export_round_trip_ep2(directory: str) -> tuple[dict, list[dict]]:
    """At world 2 as EP 2 (experts 0-3 on rank 0, 4-7 on rank 1): a fresh tiny model, each expert's weights moved by
    its global index, saved as a training checkpoint at step 2 and exported (``hf``), and the same model in the
    stacked (transformers 5 in-memory) layout, the ranks' stacks one after the other (``stacked``); each loaded into
    a model of another seed -> this rank's expert stacks as saved, and as each layout loaded them."""
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    checkpointer, model = checkpointer_of(directory / "run", EP2)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                for param in module.parameters(recurse=False):
                    local = local_shard(param)
                    local.add_(torch.arange(module.expert_offset, module.expert_offset + len(local)).view(-1, 1, 1))
    saved = _local_expert_stacks(model)
    checkpointer.save(Progress(2, [1.0, 0.5]))
    ranks = [None, None]
    dist.all_gather_object(ranks, saved)
    if dist.get_rank() == 0:
        export(directory / "run" / "checkpoints" / "step_00000002", directory / "hf")
        whole = {name: torch.cat([torch.from_numpy(rank[name][1]) for rank in ranks]) for name in saved}
        dense = {k: v for k, v in load_file(directory / "hf" / SINGLE).items() if ".mlp.experts." not in k}
        (directory / "stacked").mkdir()
        save_file(dense | whole, directory / "stacked" / SINGLE)
    dist.barrier()
    cfg = compose_train([*SMALL, *EP2, "trainer.seed=1"])
    loaded = []
    for layout in ("hf", "stacked"):
        other = build_model(cfg, config.validate(cfg), torch.device("cpu"), torch.float32)
        load_hf_checkpoint(other, directory / layout)
        loaded.append(_local_expert_stacks(other))
    return saved, loaded


def test_export_and_import_at_ep2_keep_the_global_expert_order(tmp_path):
    """A checkpoint EP 2 ranks wrote exports each expert under its global index: expert e is rank e // 4's local
    expert e % 4, gate_proj the first half of its gate_up_proj rows and up_proj the second. Loaded back at EP 2, from
    that published per-expert layout and from the stacked one, each rank gets the experts it saved."""
    (saved0, loaded0), (saved1, loaded1) = run_world(2, _export_round_trip_ep2, str(tmp_path))
    assert [{offset for offset, _ in saved.values()} for saved in (saved0, saved1)] == [{0}, {4}]
    whole = {name: torch.cat([torch.from_numpy(saved0[name][1]), torch.from_numpy(saved1[name][1])]) for name in saved0}
    assert len(whole) == 4  # two layers' gate_up_proj and down_proj

    reader = CheckpointReader(tmp_path / "hf")
    for name, stack in whole.items():
        prefix, _, kind = name.rpartition(".")
        for e in range(8):
            if kind == "gate_up_proj":
                half = (stack.shape[1] // 2, stack.shape[2])
                gate, up = (
                    reader.get(f"{prefix}.{e}.{p}.weight", half, torch.float32) for p in ("gate_proj", "up_proj")
                )
                assert torch.equal(torch.cat([gate, up]), stack[e]), (name, e)
            else:
                down = reader.get(f"{prefix}.{e}.down_proj.weight", stack.shape[1:], torch.float32)
                assert torch.equal(down, stack[e]), (name, e)
    for rank, saved, loaded in ((0, saved0, loaded0), (1, saved1, loaded1)):
        for layout, stacks in zip(("published", "stacked"), loaded):
            assert stacks.keys() == saved.keys()
            for name, (offset, stack) in stacks.items():
                assert offset == 4 * rank and (stack == saved[name][1]).all(), (layout, rank, name)


@pytest.mark.parametrize("max_shard_bytes", [None, 1500])
def test_exported_files_are_as_readable_as_the_rest_of_the_export(max_shard_bytes, tmp_path):
    """The safetensors files get the mode a plain file write gives (0666 less the umask), as the index beside them:
    a shared model directory is readable by the group (safetensors writes owner-only files)."""
    from moe_lab.models.hf_weights import save_hf_checkpoint

    umask = os.umask(0o022)
    try:
        save_hf_checkpoint({"a.weight": torch.ones(16, 16), "b.weight": torch.zeros(16, 16)}, tmp_path, max_shard_bytes)
        (tmp_path / "config.json").write_text("{}")  # as export() writes it
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert len(modes) == (2 if max_shard_bytes is None else 4) and set(modes.values()) == {0o644}, modes


def tiny_checkpoint(directory: Path) -> Path:
    """A complete checkpoint of two 16 x 16 weights, written without a run: what export reads of one."""
    model = {
        "vocab_size": 16,
        "hidden_size": 16,
        "num_layers": 1,
        "num_heads": 1,
        "num_kv_heads": 1,
        "head_dim": 16,
        "num_experts": 1,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 16,
        "norm_topk_prob": True,
        "max_position_embeddings": 16,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "init_std": 0.02,
        "router_aux_loss_coef": 0.001,
    }
    checkpoint = directory / "step_00000001"
    weights = {f"model/{name}.weight": torch.ones(16, 16) for name in ("model.embed_tokens", "lm_head")}
    dcp.save(weights, checkpoint_id=str(checkpoint), no_dist=True)
    (checkpoint / ckpt_dir.MARKER).write_text(json.dumps({"model": model}))
    return checkpoint


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_the_exported_config_names_the_dtype_of_the_exported_weights(dtype, tmp_path):
    """config.json's ``torch_dtype`` is what the safetensors hold: the checkpoint's (fp32 here), or ``--dtype``'s."""
    from safetensors import safe_open

    checkpoint, out = tiny_checkpoint(tmp_path), tmp_path / "hf"
    export_main([str(checkpoint), str(out), *(["--dtype", dtype] if dtype else [])])
    with safe_open(str(out / SINGLE), "pt") as weights:
        held = {str(weights.get_tensor(name).dtype) for name in weights.keys()}
    assert held == {f"torch.{dtype or 'float32'}"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == (dtype or "float32")


def test_export_refuses_a_directory_holding_an_export_before_reading_the_checkpoint(tmp_path):
    """Another export's files beside the new ones would make one directory two models (transformers prefers
    model.safetensors, the trainer the index): refused naming the directory and its files, which stay as they were."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / SINGLE).write_bytes(b"old")
    (out / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as refused:
        export_main([str(tmp_path / "no_checkpoint"), str(out)])
    assert str(refused.value) == (
        f"{out} already holds an export (config.json, {SINGLE}); pass --overwrite to replace it, or choose another "
        "directory"
    )
    assert (out / SINGLE).read_bytes() == b"old"
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match="a_file is a file, not a directory to export into"):
        export_main([str(tmp_path / "no_checkpoint"), str(tmp_path / "a_file")])


def test_export_with_overwrite_replaces_the_previous_exports_weights(tmp_path):
    checkpoint, out = tiny_checkpoint(tmp_path), tmp_path / "hf"
    (out / "notes").mkdir(parents=True)  # what is no export's stays
    export_main([str(checkpoint), str(out), "--max-shard-size", "1MB"])
    assert (out / SINGLE).is_file() and not (out / INDEX).exists()
    export_main([str(checkpoint), str(out), "--max-shard-size", "1KB", "--overwrite"])
    shards = set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert len(shards) == 2 and {p.name for p in out.glob("*.safetensors")} == shards
    assert (out / "notes").is_dir() and (out / "config.json").is_file()


def test_an_export_stopped_midway_leaves_the_directory_as_it_was(tmp_path, monkeypatch):
    """An export that stops after its first shard (killed, or failing) leaves no partial model where transformers or
    a later export would take it for one: a first export leaves nothing an export reads, a replacing one the old
    export whole. The next export clears what the stopped one staged."""
    import moe_lab.export

    checkpoint, fresh, replaced = tiny_checkpoint(tmp_path), tmp_path / "fresh", tmp_path / "replaced"
    export_main([str(checkpoint), str(replaced), "--max-shard-size", "1MB"])
    old = {path.name: path.read_bytes() for path in replaced.iterdir()}
    tensors = moe_lab.export.published_tensors
    calls = []

    def stopping(*args):
        calls.append(args)
        if len(calls) > 1:
            raise KeyboardInterrupt  # as a kill stops it: nothing of the export's own cleans up
        return tensors(*args)

    monkeypatch.setattr(moe_lab.export, "published_tensors", stopping)
    for out, flags in ((fresh, []), (replaced, ["--overwrite"])):
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            export_main([str(checkpoint), str(out), "--max-shard-size", "1KB", *flags])
    assert [path.name for path in fresh.iterdir()] == [".export.partial"]
    assert {path.name: path.read_bytes() for path in replaced.iterdir() if path.is_file()} == old
    monkeypatch.setattr(moe_lab.export, "published_tensors", tensors)
    export_main([str(checkpoint), str(fresh), "--max-shard-size", "1KB"])  # not "already holds an export"
    assert (fresh / INDEX).is_file() and not (fresh / ".export.partial").exists()


def test_export_of_a_damaged_checkpoint_names_the_file_and_a_bias_balanced_run_is_warned(tmp_path, caplog, capsys):
    """A data file cut short is said as resuming says it (not an unpickler's EOFError); a run that chose its experts
    with a balancing bias exports a model that routes without it (transformers' Qwen3MoE has none): said."""
    checkpoint = tiny_checkpoint(tmp_path)
    marker = ckpt_dir.read_marker(checkpoint)
    marker["model"]["router_balance"] = "bias"
    (checkpoint / ckpt_dir.MARKER).write_text(json.dumps(marker))
    with caplog.at_level("WARNING", logger="moe_lab"):
        export_main([str(checkpoint), str(tmp_path / "hf")])
    assert "model.router_balance=bias" in caplog.text and "a token may take other experts" in caplog.text
    data = next(checkpoint.glob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(SystemExit, match=f"checkpoint {checkpoint} is damaged: {data.name}: cut short: 10 bytes"):
        export_main([str(checkpoint), str(tmp_path / "hf2")])

    with pytest.raises(SystemExit):  # a size of no bytes would write each tensor to a file of its own
        export_main([str(tiny_checkpoint(tmp_path / "intact")), str(tmp_path / "hf3"), "--max-shard-size", "0"])
    assert "not a size: '0' (must be > 0)" in capsys.readouterr().err and not (tmp_path / "hf3").exists()
