"""Optimizers of the ``optimizer`` group that torch does not ship. ``adamw`` is ``torch.optim.AdamW`` itself."""

from __future__ import annotations

import torch


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
