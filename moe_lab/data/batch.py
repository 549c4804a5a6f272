"""What a data option hands the trainer for each step: one rank's share of the step's global batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lab.models.qwen3_moe import Documents


@dataclass
class Batch:
    inputs: torch.Tensor  # [B, S] token ids
    labels: torch.Tensor  # [B, S] the next token of each input
    documents: Documents | None = None  # where packed documents lie, when attention must stay inside each

    def to(self, device: torch.device) -> Batch:
        documents = self.documents.to(device) if self.documents is not None else None
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), documents)
