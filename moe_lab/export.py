"""A training checkpoint as a Hugging Face model: sharded safetensors in the published per-expert layout, their
index, and config.json from the run's model config, which transformers' ``Qwen3MoeForCausalLM`` loads.

    python -m moe_lab.export outputs/<date>/<time>/checkpoints/step_00000100 exported/ [--max-shard-size 5GB]
        [--dtype bfloat16] [--overwrite]

Whatever mesh wrote the checkpoint, each tensor is read whole (DCP reassembles FSDP shards and EP slices), a
shard's worth at a time. Where the run kept fp32 masters apart from the model's weights (offload=full), the masters
are exported. Tensors keep the checkpoint's dtype unless ``--dtype`` says otherwise. An ``out`` already holding an
export is refused unless ``--overwrite`` says to replace it: the old files beside the new ones would make one
directory two models (transformers reads ``model.safetensors`` before an index, the trainer the index).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moe_lab.checkpoint import directory as ckpt_dir
from moe_lab.checkpoint.checkpointer import find_damage, writer_kept_masters
from moe_lab.models.hf_weights import INDEX, SafetensorsWriter, published_tensors
from moe_lab.optim.offload.full import MASTER

log = logging.getLogger("moe_lab")
HF_CONFIG = "config.json"
STAGING = ".export.partial"
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def export(
    checkpoint: str | Path,
    out: str | Path,
    max_shard_bytes: int | None = 5 * 10**9,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> None:
    checkpoint, out = Path(checkpoint), Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory to export into")
    previous = previous_export(out)
    if previous and not overwrite:
        raise ValueError(
            f"{out} already holds an export ({_listed(previous)}); pass --overwrite to replace it, or choose another "
            "directory"
        )
    problem = ckpt_dir.why_incomplete(checkpoint)
    if problem is not None:
        raise ValueError(f"{checkpoint} is not a complete training checkpoint: {problem}")
    if damage := find_damage(checkpoint):  # as resuming it would say, not an unpickler's EOFError
        raise ValueError(f"checkpoint {checkpoint} is damaged: {damage[0]}: {damage[1]}")
    marker = ckpt_dir.read_marker(checkpoint)
    model = marker["model"]
    if model.get("routing", "learned") != "learned":
        log.warning(
            "the run forced its routing (model.routing=%s); the export holds the router's weights, which "
            "transformers routes by",
            model["routing"],
        )
    if model.get("router_balance") == "bias":
        log.warning(
            "the run chose its experts with a balancing bias on the router's scores (model.router_balance=bias); "
            "transformers' Qwen3MoE has none: the export routes by the router's weights alone, so a token may "
            "take other experts than in the run"
        )
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    sources = {}  # parameter name -> the key holding its values
    masters = writer_kept_masters(marker)  # offload=full's fp32 weights, where it wrote the checkpoint
    for key in saved:
        if key.startswith("model/"):
            name = key.removeprefix("model/")
            master = f"optimizer/{name}/{MASTER}"
            sources[name] = master if masters and master in saved else key
    # Written aside, then moved in once whole: a killed export leaves the directory as it was (and its staging
    # directory, which the next export clears), never a partial model that loads or reads as "already an export".
    staging = out / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    writer = SafetensorsWriter(staging, max_shard_bytes)
    for batch in _batches(sources, saved, max_shard_bytes):
        target = {
            sources[name]: torch.empty(saved[sources[name]].size, dtype=saved[sources[name]].properties.dtype)
            for name in batch
        }
        dcp.load(
            target,
            checkpoint_id=str(checkpoint),
            planner=dcp.DefaultLoadPlanner(flatten_state_dict=False),
            no_dist=True,
        )
        for name in batch:
            tensor = target[sources[name]]
            for published, matrix in published_tensors(name, tensor if dtype is None else tensor.to(dtype)):
                writer.add(published, matrix)
    writer.close()
    weights_dtype = dtype or saved[next(iter(sources.values()))].properties.dtype
    (staging / HF_CONFIG).write_text(json.dumps(hf_config(model, weights_dtype), indent=2))
    for path in previous:
        path.unlink()
    for path in sorted(staging.iterdir(), key=lambda path: path.name == HF_CONFIG):  # config.json last
        path.replace(out / path.name)
    staging.rmdir()


def previous_export(out: Path) -> list[Path]:
    """The files of an export already in ``out``, by name."""
    found = [*out.glob("*.safetensors"), out / INDEX, out / HF_CONFIG] if out.is_dir() else []
    return sorted((path for path in found if path.is_file()), key=lambda path: path.name)


def _listed(paths: list[Path], most: int = 3) -> str:
    names = [path.name for path in paths]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _batches(sources: dict, saved: dict, max_bytes: int | None) -> list[list[str]]:
    """Parameter names in runs of about ``max_bytes`` as saved (one run without a limit)."""
    batches, size = [[]], 0
    for name, key in sources.items():
        meta = saved[key]
        nbytes = meta.size.numel() * meta.properties.dtype.itemsize
        if batches[-1] and max_bytes is not None and size + nbytes > max_bytes:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += nbytes
    return batches


def hf_config(model: dict, dtype: torch.dtype) -> dict:
    """transformers' Qwen3MoeConfig of a moe_lab model config (every layer MoE, no dense MLP layers)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model["head_dim"],
        "num_experts": model["num_experts"],
        "num_experts_per_tok": model["num_experts_per_tok"],
        "moe_intermediate_size": model["moe_intermediate_size"],
        "norm_topk_prob": model["norm_topk_prob"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": model["max_position_embeddings"],
        "rope_theta": model["rope_theta"],
        "rms_norm_eps": model["rms_norm_eps"],
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": model["init_std"],
        "router_aux_loss_coef": model["router_aux_loss_coef"],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def parse_size(text: str) -> int:
    """'5GB' -> 5e9, '500MiB' -> 500 * 2**20, '1000' -> 1000 bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MiB)")
    size = int(float(match.group(1)) * UNITS[match.group(2).upper()])
    if size <= 0:  # every tensor a file of its own
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (must be > 0)")
    return size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe_lab.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a complete training checkpoint: <checkpoint dir>/step_<N>")
    parser.add_argument("out", help="directory for the Hugging Face model (created; one holding an export is refused)")
    parser.add_argument(
        "--max-shard-size", type=parse_size, default="5GB", help="largest safetensors file (default 5GB)"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights (default: as saved)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the export already in out (its weights, index and config)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        export(args.checkpoint, args.out, args.max_shard_size, dtype, args.overwrite)
    except (ValueError, OSError) as e:  # an OSError: an output directory that cannot be made or written
        sys.exit(str(e))
    log.info("exported %s to %s", args.checkpoint, args.out)


if __name__ == "__main__":
    main()
