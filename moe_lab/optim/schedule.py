"""Learning-rate schedules, as ``torch.optim.lr_scheduler`` schedulers so they drive any torch optimizer, the offload
modes' included."""

from __future__ import annotations

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(
    optimizer: Optimizer, steps: int, warmup_steps: int, min_lr_ratio: float, start_step: int = 0
) -> LambdaLR:
    """Linear warmup, then cosine decay to ``lr * min_lr_ratio`` at the last step (``lr``: each group's LR now).

    Step ``s`` (from 0) runs with ``lr * f(s)``:
        f(s) = (s + 1) / warmup_steps                                    for s < warmup_steps,
        f(s) = min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2  after, p = (s - warmup_steps) / T,
    with T = max(1, steps - warmup_steps - 1), so the decay starts at 1 and reaches ``min_lr_ratio`` at step
    ``steps - 1`` (a run with one step after its warmup runs that step at ``lr``: the decay's start is its end).
    ``warmup_steps`` may be 0, or ``>= steps`` (a run that ends inside its warmup).

    The scheduler sets step ``start_step``'s LR when built (a resumed run's first step: a function of the step and
    these arguments alone, so a run resumed with other ones follows theirs from there); call ``scheduler.step()``
    after each ``optimizer.step()``.
    """
    if steps < 1 or warmup_steps < 0 or start_step < 0:
        raise ValueError(
            "warmup_cosine needs steps >= 1, warmup_steps >= 0 and start_step >= 0, "
            f"got {steps}, {warmup_steps} and {start_step}"
        )
    for group in optimizer.param_groups:
        # The base LR is the group's LR now; torch reads it here when resuming (last_epoch >= 0), and would keep an
        # earlier scheduler's otherwise.
        group["initial_lr"] = group["lr"]
    factor = functools.partial(warmup_cosine_factor, steps=steps, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio)
    return LambdaLR(optimizer, factor, last_epoch=start_step - 1)


def warmup_cosine_factor(step: int, *, steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """``f(step)`` of ``warmup_cosine``'s docstring (held at ``min_lr_ratio`` past the last step)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps - 1))
    return min_lr_ratio + (1 - min_lr_ratio) * (1 + math.cos(math.pi * progress)) / 2
