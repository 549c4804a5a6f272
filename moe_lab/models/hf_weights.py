"""Hugging Face safetensors checkpoints (single file or sharded with an index) in and out of Qwen3-MoE.

On disk, experts are per-expert matrices (``mlp.experts.{e}.gate_proj.weight`` ...), as published; in memory they
are stacks (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), as in transformers 5.
Loading works on a parallelised model: each rank reads only its experts and its shard of every DTensor.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from moe_lab.moe.experts import GroupedExperts
from moe_lab.runtime.files import give_plain_file_mode

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the checkpoint and the file or tensor."""


class CheckpointReader:
    """Tensors of a safetensors checkpoint by name, from a sharded (index) or single-file checkpoint; raises
    FileNotFoundError for a directory that holds neither."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._files: dict = {}
        if (self.directory / INDEX).exists():
            try:
                self.weight_map = json.loads((self.directory / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(
                    f"checkpoint {self.directory}: {INDEX} has no readable weight_map ({e!r})"
                ) from None
        elif (self.directory / SINGLE).exists():
            self.weight_map = {key: SINGLE for key in self._file(SINGLE).keys()}
        else:
            raise FileNotFoundError(f"checkpoint {self.directory}: no {INDEX} or {SINGLE} there")

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def _file(self, name: str):
        if name not in self._files:
            try:
                self._files[name] = safe_open(self.directory / name, "pt")
            except Exception as e:  # missing or not a safetensors file
                raise CheckpointError(f"checkpoint {self.directory}: cannot open {name}: {e}") from None
        return self._files[name]

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``key``, which must have ``shape`` and, for a floating-point ``dtype``, be floating point (an
        integer tensor is refused rather than cast)."""
        if key not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.directory}: no tensor {key}")
        name = self.weight_map[key]
        file = self._file(name)
        try:
            tensor = file.get_tensor(key)
        except Exception as e:  # listed in the index but absent from its file, or a damaged file
            raise CheckpointError(f"checkpoint {self.directory}: cannot read tensor {key} from {name}: {e}") from None
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"checkpoint {self.directory}: tensor {key} has shape {tuple(tensor.shape)}, the model expects {tuple(shape)}"
            )
        if dtype.is_floating_point and not tensor.dtype.is_floating_point:
            raise CheckpointError(
                f"checkpoint {self.directory}: tensor {key} has dtype {tensor.dtype}, the model's weight is {dtype} (not cast)"
            )
        return tensor


def _expert_stack(reader: CheckpointReader, prefix: str, kind: str, experts: GroupedExperts, param) -> torch.Tensor:
    """This rank's experts of stack ``kind`` ([L, ...] as ``param``, global experts from ``experts.expert_offset``),
    from the stacked layout or the published per-expert matrices, each checked against the model's shape."""
    local = range(experts.expert_offset, experts.expert_offset + experts.num_local_experts)
    matrix = tuple(param.shape[1:])  # a DTensor's shape is its global one: the EP-local stack's
    stacked = f"{prefix}.{kind}"
    if stacked in reader:  # already stacked (transformers 5 in-memory layout)
        return reader.get(stacked, (experts.num_experts, *matrix), param.dtype)[local.start : local.stop]
    if kind == "gate_up_proj":
        half = (matrix[0] // 2, matrix[1])  # gate and up, each [I, H]
        matrices = [
            torch.cat(
                [reader.get(f"{prefix}.{e}.{proj}.weight", half, param.dtype) for proj in ("gate_proj", "up_proj")]
            )
            for e in local
        ]
    else:
        matrices = [reader.get(f"{prefix}.{e}.down_proj.weight", matrix, param.dtype) for e in local]
    return torch.stack(matrices)


@torch.no_grad()
def load_hf_checkpoint(model: torch.nn.Module, directory: str | Path) -> None:
    """Fill the model's parameters (plain or DTensor, EP-sliced experts included) from a checkpoint directory; any
    tensor missing, of another shape than the model's or of an integer dtype raises ``CheckpointError`` naming it,
    before it is distributed over the mesh."""
    reader = CheckpointReader(directory)
    modules = dict(model.named_modules())
    unknown = sorted(set(reader.weight_map) - model_tensor_names(model))
    if unknown and not (torch.distributed.is_initialized() and torch.distributed.get_rank() > 0):
        shown = ", ".join(unknown[:8]) + (f", ... ({len(unknown)} in all)" if len(unknown) > 8 else "")
        log.warning("checkpoint %s holds tensors the model does not have, left unread: %s", directory, shown)
    for name, param in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        module = modules[module_name]
        if isinstance(module, GroupedExperts):
            full = _expert_stack(reader, module_name, kind, module, param)
        else:
            full = reader.get(name, tuple(param.shape), param.dtype)
        if isinstance(param, DTensor):
            full = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(full.to_local())
        else:
            param.copy_(full)


def model_tensor_names(model: torch.nn.Module) -> set[str]:
    """Every name under which a checkpoint may hold one of the model's tensors: parameter names, and for expert
    stacks the stacked name and the published per-expert names of every expert (on any EP rank)."""
    names = set()
    for module_name, module in model.named_modules():
        for kind, _ in module.named_parameters(recurse=False):
            names.add(f"{module_name}.{kind}" if module_name else kind)
            if isinstance(module, GroupedExperts):
                projections = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                names.update(
                    f"{module_name}.{e}.{proj}.weight" for e in range(module.num_experts) for proj in projections
                )
    return names


def published_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One of the model's tensors in the published per-expert layout: an expert stack becomes a matrix per expert
    and projection, anything else stays as it is."""
    prefix, _, kind = name.rpartition(".")
    if kind == "gate_up_proj":
        out = []
        for e, stacked in enumerate(tensor):
            gate, up = stacked.chunk(2)
            out += [
                (f"{prefix}.{e}.gate_proj.weight", gate.contiguous()),
                (f"{prefix}.{e}.up_proj.weight", up.contiguous()),
            ]
        return out
    if kind == "down_proj" and prefix.endswith("mlp.experts"):
        return [(f"{prefix}.{e}.down_proj.weight", matrix.contiguous()) for e, matrix in enumerate(tensor)]
    return [(name, tensor.contiguous())]


class SafetensorsWriter:
    """Tensors into a Hugging Face checkpoint directory as they come, holding one shard in memory: files of at most
    ``max_shard_bytes`` (a larger tensor gets one of its own), ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``, or one ``model.safetensors`` when everything fits in one (or no limit)."""

    def __init__(self, directory: str | Path, max_shard_bytes: int | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []  # (file, its tensors) of the shards written so far
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.shard and self.max_shard_bytes is not None and self.shard_bytes + size > self.max_shard_bytes:
            self._flush()
        self.shard[name] = tensor
        self.shard_bytes += size
        self.total_bytes += size

    def close(self) -> None:
        if self.shard or not self.written:
            self._flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.directory / SINGLE)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self.written, 1):
            final = f"model-{i:05d}-of-{len(self.written):05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2))

    def _flush(self) -> None:
        path = self.directory / f".shard-{len(self.written) + 1:05d}.safetensors"  # renamed once the count is known
        save_file(self.shard, str(path), metadata={"format": "pt"})
        give_plain_file_mode(path)  # as the index and config.json beside it
        self.written.append((path, list(self.shard)))
        self.shard, self.shard_bytes = {}, 0


def save_hf_checkpoint(
    state_dict: dict[str, torch.Tensor], directory: str | Path, max_shard_bytes: int | None = None
) -> None:
    """Write an unsharded model's state dict in the published per-expert layout: one file, or shards of at most
    ``max_shard_bytes`` with an index."""
    writer = SafetensorsWriter(directory, max_shard_bytes)
    for name, tensor in state_dict.items():
        for published, matrix in published_tensors(name, tensor):
            writer.add(published, matrix)
    writer.close()
