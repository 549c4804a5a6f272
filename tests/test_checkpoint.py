"""Loading a checkpoint that does not fit the model fails with a message naming the checkpoint and the tensor (issue
14): a shape mismatch at world 1 and at world 2 with EP=2 (FSDP2 DTensors, each rank's slice of the experts, checked
before the tensor is distributed), a missing tensor or file, an integer tensor for a float weight (refused, not cast)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moe_lab.models.hf_weights import INDEX, SINGLE, CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from moe_lab.moe.dispatcher import TorchDispatcher
from moe_lab.parallel.expert_parallel import apply_expert_parallel
from moe_lab.parallel.fsdp import apply_fsdp
from moe_lab.parallel.mesh import build_meshes
from tests.distributed import run_world

TINY = Qwen3MoeConfig.preset("tiny")  # hidden 64, expert intermediate 32, 8 experts, vocab 512, 2 layers


def write_checkpoint(directory, cfg: Qwen3MoeConfig = TINY) -> None:
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    save_hf_checkpoint(model.state_dict(), directory)


def write_state_dict(directory, edit) -> None:
    """The tiny model's state dict in the stacked (in-memory) layout, as ``edit`` changes it."""
    torch.manual_seed(0)
    model = TINY.build()
    model.init_weights()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    edit(state)
    save_file(state, str(directory / SINGLE))


def load_error(directory) -> str:
    with torch.device("meta"):
        model = TINY.build()
    model.to_empty(device="cpu")
    with pytest.raises(CheckpointError) as failure:
        load_hf_checkpoint(model, directory)
    return str(failure.value)


def test_loads_what_it_saved(tmp_path):
    write_checkpoint(tmp_path)
    torch.manual_seed(0)
    saved = TINY.build()
    saved.init_weights()
    with torch.device("meta"):
        model = TINY.build()
    model.to_empty(device="cpu")
    load_hf_checkpoint(model, tmp_path)
    for (name, p), q in zip(saved.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_unknown_tensors_are_named_in_a_warning_and_model_tensors_are_not(tmp_path, caplog):
    def add_strangers(state):
        state["optimizer.exp_avg"] = torch.zeros(3)
        state["model.layers.9.mlp.gate.weight"] = torch.zeros(8, 64)  # a layer this 2-layer proxy does not have

    write_state_dict(tmp_path, add_strangers)
    with torch.device("meta"):
        model = TINY.build()
    model.to_empty(device="cpu")
    with caplog.at_level("WARNING", logger="moe_lab.models.hf_weights"):
        load_hf_checkpoint(model, tmp_path)
    assert "model.layers.9.mlp.gate.weight, optimizer.exp_avg" in caplog.text
    caplog.clear()
    write_checkpoint(tmp_path / "published")  # per-expert names of every expert are model tensors
    with caplog.at_level("WARNING", logger="moe_lab.models.hf_weights"):
        load_hf_checkpoint(model, tmp_path / "published")
    assert caplog.text == ""


@pytest.mark.parametrize(
    "other, tensor, shape, expected",
    [
        (dict(moe_intermediate_size=16), "model.layers.0.mlp.experts.0.gate_proj.weight", (16, 64), (32, 64)),
        (dict(vocab_size=256), "model.embed_tokens.weight", (256, 64), (512, 64)),
    ],
)
def test_shape_mismatch_names_the_tensor(tmp_path, other, tensor, shape, expected):
    write_checkpoint(tmp_path, replace(TINY, **other))
    assert (
        load_error(tmp_path)
        == f"checkpoint {tmp_path}: tensor {tensor} has shape {shape}, the model expects {expected}"
    )


def test_stacked_experts_of_another_count_name_the_stack(tmp_path):
    def fewer_experts(state):
        state["model.layers.1.mlp.experts.down_proj"] = state["model.layers.1.mlp.experts.down_proj"][:4].clone()

    write_state_dict(tmp_path, fewer_experts)
    message = load_error(tmp_path)
    assert (
        message
        == f"checkpoint {tmp_path}: tensor model.layers.1.mlp.experts.down_proj has shape (4, 64, 32), the model expects (8, 64, 32)"
    )


def test_missing_tensor_is_named(tmp_path):
    write_state_dict(tmp_path, lambda state: state.pop("model.norm.weight"))
    assert load_error(tmp_path) == f"checkpoint {tmp_path}: no tensor model.norm.weight"


def test_integer_tensor_for_a_float_weight_is_refused(tmp_path):
    def integer_head(state):
        state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"], dtype=torch.int64)

    write_state_dict(tmp_path, integer_head)
    expected = f"checkpoint {tmp_path}: tensor lm_head.weight has dtype torch.int64, the model's weight is torch.float32 (not cast)"
    assert load_error(tmp_path) == expected


def test_missing_file_of_the_index_is_named(tmp_path):
    write_checkpoint(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00002.safetensors"}}
    (tmp_path / INDEX).write_text(json.dumps(index))  # an index is read before a single file
    assert load_error(tmp_path).startswith(f"checkpoint {tmp_path}: cannot open model-00002.safetensors")


def test_no_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"checkpoint {tmp_path}: no {INDEX} or {SINGLE}")):
        load_error(tmp_path)


def _load_ep2(directory: str) -> str:
    """The tiny model at world 2 as EP=2 with FSDP2 (experts 0-3 on rank 0, 4-7 on rank 1): the load's error."""
    meshes = build_meshes("cpu", 2)
    with torch.device("meta"):
        model = TINY.build()
    apply_expert_parallel(model, TorchDispatcher().set_ep_group(meshes.ep.get_group()), meshes.ep.get_local_rank(), 2)
    apply_fsdp(model, meshes, torch.float32)
    model.to_empty(device="cpu")
    try:
        load_hf_checkpoint(model, directory)
    except CheckpointError as e:
        return str(e)
    return f"rank {dist.get_rank()} loaded it"


@pytest.mark.parametrize(
    "other, first_tensor, shape, expected",
    [
        (
            dict(moe_intermediate_size=16),
            "model.layers.0.mlp.experts.{first_expert}.gate_proj.weight",
            (16, 64),
            (32, 64),
        ),
        (dict(vocab_size=256), "model.embed_tokens.weight", (256, 64), (512, 64)),
    ],
)
def test_shape_mismatch_at_ep2_names_the_tensor(tmp_path, other, first_tensor, shape, expected):
    write_checkpoint(tmp_path, replace(TINY, **other))
    for rank, message in enumerate(run_world(2, _load_ep2, str(tmp_path))):
        tensor = first_tensor.format(first_expert=4 * rank)  # each rank reads its own experts
        assert message == f"checkpoint {tmp_path}: tensor {tensor} has shape {shape}, the model expects {expected}"
