"""Hugging Face safetensors checkpoints (single file or sharded with an index) in and out of Qwen3-MoE.

On disk, experts are per-expert matrices (``mlp.experts.{e}.gate_proj.weight`` ...), as published; in memory they
are stacks (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), as in transformers 5.
Loading works on a parallelised model: each rank reads only its experts and its shard of every DTensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class _Reader:
    def __init__(self, directory: str | Path):
        directory = Path(directory)
        if (directory / INDEX).exists():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        elif (directory / SINGLE).exists():
            with safe_open(directory / SINGLE, "pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(f"no {INDEX} or {SINGLE} in {directory}")
        self.directory, self.weight_map, self._files = directory, weight_map, {}

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise KeyError(f"checkpoint {self.directory} has no tensor {key!r}")
        name = self.weight_map[key]
        if name not in self._files:
            self._files[name] = safe_open(self.directory / name, "pt")
        return self._files[name].get_tensor(key)


def _expert_stack(reader: _Reader, prefix: str, kind: str, experts: range) -> torch.Tensor:
    if f"{prefix}.{kind}" in reader:  # already stacked (transformers 5 in-memory layout)
        return reader.get(f"{prefix}.{kind}")[experts.start : experts.stop]
    if kind == "gate_up_proj":
        rows = [
            torch.cat([reader.get(f"{prefix}.{e}.gate_proj.weight"), reader.get(f"{prefix}.{e}.up_proj.weight")])
            for e in experts
        ]
    else:
        rows = [reader.get(f"{prefix}.{e}.down_proj.weight") for e in experts]
    return torch.stack(rows)


@torch.no_grad()
def load_hf_checkpoint(model: torch.nn.Module, directory: str | Path) -> None:
    reader = _Reader(directory)
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        if kind in ("gate_up_proj", "down_proj") and module_name.endswith("mlp.experts"):
            experts = modules[module_name]
            offset = getattr(experts, "expert_offset", 0)
            full = _expert_stack(reader, module_name, kind, range(offset, offset + experts.num_local_experts))
        else:
            full = reader.get(name)
        if isinstance(param, DTensor):
            full = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(full.to_local())
        else:
            if full.shape != param.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(param.shape)}")
            param.copy_(full)


def save_hf_checkpoint(state_dict: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Write an unsharded model's state dict in the published per-expert layout (one file)."""
    out = {}
    for name, tensor in state_dict.items():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            for e, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        elif kind == "down_proj" and prefix.endswith("mlp.experts"):
            for e, matrix in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = matrix.contiguous()
        else:
            out[name] = tensor.contiguous()
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file(out, str(Path(directory) / SINGLE), metadata={"format": "pt"})
