"""What a data option is (``DataSource``, the ``data`` group's contract) and what it hands the trainer for each
step: one rank's share of the step's global batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from moe_lab.models.qwen3_moe import Documents
from moe_lab.runtime.errors import ConfigError


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, S] token ids
    labels: torch.Tensor  # [B, S] the next token of each input
    documents: Documents | None = None  # where packed documents lie, when attention must stay inside each

    def to(self, device: torch.device) -> Batch:
        documents = self.documents.to(device) if self.documents is not None else None
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), documents)


@runtime_checkable
class DataSource(Protocol):
    """What a ``data`` option provides. Validation calls ``validate``; the trainer ``batch`` for each micro-batch of
    each step and ``eval_batch`` for evaluation; the checkpointer ``state_dict`` / ``load_state_dict`` (one state
    per rank). A batch is a function of its arguments, so every mesh shape trains on the same global batch."""

    def validate(self, cfg, target) -> None:
        """Refuse, with a ``ConfigError`` naming the key, a composed config these batches do not fit (a vocabulary
        larger than the model's; ``target``: where they are read, ``moe_lab.runtime.device.Target``); the default
        accepts every config."""

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batch: int = 0, micro_batches: int = 1) -> Batch:
        """Micro-batch ``micro_batch`` (of ``micro_batches``) of rank ``dp_rank``'s (of ``dp_size``) share of step
        ``step``'s global batch, [batch_size, seq_len] on the CPU."""
        ...

    def eval_batch(self, index: int, dp_rank: int, dp_size: int, micro_batch: int = 0, micro_batches: int = 1) -> Batch:
        """Micro-batch ``micro_batch`` (of ``micro_batches``) of rank ``dp_rank``'s share of held-out batch
        ``index`` (as large as a step's global batch, and split alike), drawn from what no training step reads."""
        ...

    def state_dict(self) -> dict:
        """Where the reader stands, for a checkpoint: a function of the global batch, the same on every rank (a run
        resumed at another world size loads rank 0's)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Continue from what ``state_dict`` returned; refuse another data option's (``refuse_another_sources_state``)."""
        ...


def refuse_another_sources_state(state: dict, keys: set[str], option: str) -> None:
    """Refuse a checkpointed data position that is not of the ``data`` option ``option`` (whose state holds
    ``keys``): a run resumed under another data option than the checkpoint's."""
    if set(state) != keys:
        raise ConfigError(
            "data",
            f"the checkpoint was written with another data source (its data position's keys: {_listed(state)}; "
            f"data={option}'s: {_listed(keys)}); resume it with the data option that wrote it",
        )


def _listed(keys) -> str:
    return ", ".join(sorted(keys)) or "none"
