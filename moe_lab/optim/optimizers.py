"""The ``optimizer`` group: its contract (``OptimizerFactory``) and the optimizers torch does not ship. ``adamw`` is
``torch.optim.AdamW`` itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class OptimizerFactory(Protocol):
    """What an ``optimizer`` option is once built: its yaml names a ``torch.optim.Optimizer`` class with
    ``_partial_: true``, so Hydra builds a partial that the offload option calls with the parameters it keeps (all of
    them, or each chunk's). Validation checks the shared hyperparameters' ranges on the config's values
    (``moe_lab.config.validate.check_optimizer``); the offload options refuse optimizers they cannot step."""

    def __call__(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """A fresh optimizer over ``params`` with the option's hyperparameters."""
        ...


class SignSGD(torch.optim.Optimizer):
    """p <- p * (1 - lr * weight_decay) - lr * sign(g): sign descent with decoupled weight decay, no state."""

    def __init__(self, params, lr: float = 1e-4, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1.0 - group["lr"] * group["weight_decay"])
            torch._foreach_add_(params, torch._foreach_sign([p.grad for p in params]), alpha=-group["lr"])
