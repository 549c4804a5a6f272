"""Learning-rate schedules, built from ``torch.optim.lr_scheduler`` so they drive any torch optimizer, the offload
modes' included."""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR


def warmup_cosine(optimizer: Optimizer, steps: int, warmup_steps: int, min_lr_ratio: float) -> LRScheduler:
    """Linear warmup, then cosine decay to ``lr * min_lr_ratio`` at the last step (``lr``: the groups' LR now).

    Step ``s`` (from 0) runs with ``lr * f(s)``:
        f(s) = (s + 1) / warmup_steps                                    for s < warmup_steps,
        f(s) = min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2  after, p = (s - warmup_steps) / T,
    with T = max(1, steps - warmup_steps - 1), so the decay starts at 1 and reaches ``min_lr_ratio`` at step
    ``steps - 1``. ``warmup_steps`` may be 0, or ``>= steps`` (a run that ends inside its warmup).

    The scheduler sets step 0's LR when built; call ``scheduler.step()`` after each ``optimizer.step()``.
    """
    if steps < 1 or warmup_steps < 0:
        raise ValueError(f"warmup_cosine needs steps >= 1 and warmup_steps >= 0, got {steps} and {warmup_steps}")
    lrs = {group["lr"] for group in optimizer.param_groups}
    if len(lrs) != 1:  # CosineAnnealingLR's floor is one absolute LR for every group
        raise ValueError(f"warmup_cosine needs one LR in every param group, got {sorted(lrs)}")
    decay = CosineAnnealingLR(optimizer, T_max=max(1, steps - warmup_steps - 1), eta_min=lrs.pop() * min_lr_ratio)
    if warmup_steps == 0:
        return decay
    # Epoch e of LinearLR multiplies by 1/w + (1 - 1/w) * e / (w - 1) = (e + 1) / w, reaching 1 at e = w - 1.
    warmup = LinearLR(optimizer, start_factor=1 / warmup_steps, end_factor=1.0, total_iters=max(1, warmup_steps - 1))
    return SequentialLR(optimizer, [warmup, decay], milestones=[warmup_steps])
