"""Structured schema of the top-level config: the one source of the trainer / parallel / profile defaults (train.yaml
holds only the defaults list and Hydra's settings). Group options (model, dispatcher, ...) are checked against the
signature of the class their ``_target_`` names (``moe_lab.config.validate``), so each option's class is its schema.
Each field's ``help`` is what ``python -m moe_lab.train --help`` prints for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore

from moe_lab.runtime.paths import CONF_DIR


def _key(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class CheckpointConfig:
    every: int | None = _key(0, "save a training checkpoint every N steps; 0 or null: never (but see on_signal)")
    dir: str | None = _key(None, "where checkpoints go; null: <run dir>/checkpoints (one directory per run)")
    keep: int | None = _key(2, "complete checkpoints kept, the newest; older ones are deleted; null keeps all")
    on_signal: bool = _key(False, "on SIGTERM / SIGINT, save a checkpoint at the step every rank stops at")
    async_save: bool = _key(False, "write checkpoints in the background (a host copy of the state is taken first)")


@dataclass
class TrainerConfig:
    steps: int = _key(100, "optimizer steps of the run")
    grad_accum: int = _key(
        1,
        "micro-batches per optimizer step, each data.batch_size samples per rank; the step's loss is their mean, its "
        "tokens (and tokens/s, MFU) count them all",
    )
    warmup_steps: int = _key(10, "linear LR warmup steps, then cosine decay to the last step")
    min_lr_ratio: float = _key(0.1, "cosine decays to optimizer.lr * min_lr_ratio")
    grad_clip: float | None = _key(None, "max global gradient norm; null disables clipping")
    timing_skip: int = _key(2, "first steps left out of s/step (compile, allocator warm-up)")
    nproc_per_node: int = _key(
        1,
        "ranks this job starts itself; ignored under an outer torchrun / srun; with parallel.emulate: the emulated "
        "layout's ranks per node (one process runs)",
    )
    device: str = _key("auto", "auto | cpu | cuda")
    precision: str = _key("auto", "auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32")
    compile: bool = _key(False, "torch.compile each decoder block (fullgraph) and the loss")
    seed: int = _key(0, "initial weights: the same seed gives the same model on every mesh shape")
    deterministic: bool = _key(
        False,
        "bitwise reproducible runs: torch's deterministic algorithms, a fixed cuBLAS workspace, Inductor's deterministic "
        "mode and seeded global generators (docs/determinism.md says what it costs)",
    )
    dry_run: bool = _key(False, "build on the meta device, print parameter counts, stop")
    init_checkpoint: str | None = _key(None, "Hugging Face safetensors directory to start from")
    checkpoint: CheckpointConfig = field(
        default_factory=CheckpointConfig, metadata={"help": "training checkpoints (torch.distributed.checkpoint)"}
    )
    resume: str = _key(
        "auto", "auto (newest complete checkpoint of trainer.checkpoint.dir, if any) | never | a checkpoint"
    )
    resume_fallback: bool = _key(
        True,
        "with trainer.resume=auto, a damaged newest checkpoint (a data file missing or cut short, its metadata "
        "unreadable) is set aside as step_<N>.damaged and the complete one before it loaded, with a warning; false: "
        "the run fails, its record naming the checkpoint and the file (true | false)",
    )
    peak_flops: float | None = _key(None, "per-GPU peak FLOP/s for MFU; null looks the GPU up")
    skip_done: bool = _key(True, "in a sweep, skip points whose directory holds an ok result of the same config")
    eval_every: int = _key(
        0, "validation loss on the held-out split every N steps and after the last (eval_loss); 0 disables"
    )
    eval_batches: int = _key(4, "held-out batches per validation, each of the training global batch size")
    expert_load_every: int = _key(
        10, "steps between expert_load rows in metrics.jsonl (tokens per expert per layer); 0: none"
    )


@dataclass
class ParallelConfig:
    ep: int = _key(
        1,
        "expert-parallel degree: EP groups are consecutive ranks (inside a node with parallel.dp_replicate > 1 or "
        "the fused dispatcher's gpu backend, and inside a replica); FSDP2 shards dense weights over a replica's "
        "ranks and experts over the replica's ranks outside their EP group",
    )
    dp_replicate: int = _key(
        1,
        "replicas (HSDP: FSDP2 on a (dp_replicate, dp_shard) mesh): the ranks form dp_replicate groups of "
        "world / dp_replicate consecutive ranks, each holding a whole sharded copy; gradients are reduce-scattered "
        "inside a group and all-reduced across groups; 1: plain FSDP2 over all ranks",
    )
    grad_sync: str = _key(
        "step",
        "with trainer.grad_accum > 1, when FSDP2 reduce-scatters gradients: step (once, after the last micro-batch; "
        "the others accumulate unsharded in fp32, 4 bytes per parameter of the unsharded model per rank) | "
        "micro_batch (after each; sharded accumulation, no unsharded gradients kept; the replicas' all-reduce "
        "still once, after the last)",
    )
    reshard_after_forward: bool = _key(
        True,
        "FSDP2's reshard_after_forward for the embedding and every block; false: they keep their gathered "
        "compute-dtype weights from forward through backward and, with trainer.grad_accum > 1, across the step's "
        "micro-batches (one all-gather per block per step instead of two per micro-batch), at the memory of the "
        "whole unsharded model (its EP share of experts) per rank",
    )
    emulate: bool = _key(
        False,
        "one process on one device runs as rank parallel.emulate_rank of the layout trainer.nproc_per_node x "
        "parallel.emulate_nodes (its real shapes, memory and compute; stand-in peers mirror it, so losses are not a "
        "model's); the record adds the planner's exposed communication for the wire (docs/emulate.md)",
    )
    emulate_rank: int = _key(0, "with parallel.emulate: the rank of the emulated layout this process runs as")
    emulate_nodes: int = _key(
        1, "with parallel.emulate: nodes of the emulated layout, trainer.nproc_per_node ranks each"
    )
    emulate_hardware: str = _key(
        "h200", "with parallel.emulate: the planner's hardware profile (conf/hardware/<name>.yaml) for the wire's time"
    )


@dataclass
class ProfileConfig:
    enabled: bool = _key(False, "torch.profiler over a window of steps: a trace per rank + a time breakdown")
    wait: int = _key(2, "steps skipped before the window (compile, allocator warm-up)")
    warmup: int = _key(1, "steps traced but discarded (profiler start-up)")
    active: int = _key(2, "steps recorded; the breakdown is their mean")


# One line per config group, for --help (the options' own lines come from their classes' docstrings).
GROUPS = {
    "model": "the Qwen3-MoE shape (model.num_layers cuts a proxy of the published depth; hf reads a config.json)",
    "dispatcher": "how tokens reach their experts and come back",
    "precision": "which GEMMs run in FP8: none, the routed experts', or theirs and the attention projections'",
    "ac": "activation checkpointing per decoder block",
    "offload": "where weights and optimizer state live",
    "optimizer": "the optimizer (a torch.optim class, built per parameter chunk by the offload mode)",
    "loss": "the LM head and the cross-entropy: all logits at once, or in chunks of tokens",
    "data": "training batches and the held-out ones trainer.eval_every reads",
    "logger": "experiment logger on rank 0, beside metrics.jsonl and result.json",
}


@dataclass
class TrainConfig:
    model: Any = None
    dispatcher: Any = None
    precision: Any = None
    ac: Any = None
    offload: Any = None
    optimizer: Any = None
    loss: Any = None
    data: Any = None
    logger: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def register() -> None:
    from omegaconf import OmegaConf

    from moe_lab.models.hf_config import read_hf_config

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    # model=hf reads each key from the checkpoint's config.json: ${hf_config:<dir>,<key>}
    OmegaConf.register_new_resolver(
        "hf_config", lambda directory, key: read_hf_config(directory, "model.path")[key], replace=True
    )


def default_options() -> dict[str, str]:
    """Each group's default option, as conf/train.yaml's defaults list names it."""
    train = yaml.safe_load((CONF_DIR / "train.yaml").read_text())
    return {group: option for d in train["defaults"] if isinstance(d, dict) for group, option in d.items()}
