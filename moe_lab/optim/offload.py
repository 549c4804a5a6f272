"""Where optimizer state lives: the ``offload`` group. Each option turns (model, optimizer factory) into the
optimizer the training loop steps; the loop never asks which option it has."""

from __future__ import annotations

from typing import Callable

import torch


class NoOffload:
    """Everything on the training device: fp32 parameters and optimizer state; compute runs in bf16 through
    autocast / FSDP2's mixed-precision policy."""

    def build(self, model: torch.nn.Module, make_optimizer: Callable) -> torch.optim.Optimizer:
        return make_optimizer(model.parameters())
