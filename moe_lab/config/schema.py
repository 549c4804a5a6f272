"""Structured schema of the top-level config. Group options (model, dispatcher, ...) are checked against the
signature of the class their ``_target_`` names (``moe_lab.config.validate``), so each option's class is its schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class TrainerConfig:
    steps: int = 100
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: Optional[float] = None  # max global grad norm; null disables clipping
    timing_skip: int = 2  # first steps excluded from s/step (compile, allocator warm-up)
    nproc_per_node: int = 1  # ranks this job starts itself; ignored under an outer torchrun / srun
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32
    compile: bool = False  # torch.compile each decoder block
    seed: int = 0
    dry_run: bool = False  # build on the meta device, print parameter counts, stop
    init_checkpoint: Optional[str] = None  # Hugging Face safetensors directory to load
    peak_flops: Optional[float] = None  # per-GPU peak FLOP/s for MFU; null looks the GPU up
    skip_done: bool = True  # in a sweep, skip points whose directory already holds an ok result of the same overrides


@dataclass
class ParallelConfig:
    dp_shard: int = -1  # ranks the dense weights are sharded over (FSDP2); -1 means all ranks
    ep: int = 1  # expert-parallel degree, borrowed from dp_shard


@dataclass
class ProfileConfig:
    enabled: bool = False  # torch.profiler over a window of steps: a trace per rank + a time breakdown in the result
    wait: int = 2  # steps skipped before the window (compile, allocator warm-up)
    warmup: int = 1  # steps traced but discarded (profiler start-up)
    active: int = 2  # steps recorded; the breakdown is their mean


@dataclass
class TrainConfig:
    model: Any = None
    dispatcher: Any = None
    ac: Any = None
    offload: Any = None
    optimizer: Any = None
    data: Any = None
    logger: Any = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def register() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
