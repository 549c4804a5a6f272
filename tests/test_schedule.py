"""warmup_cosine (torch's LambdaLR) against the schedule written out here: linear warmup to 1 over ``warmup`` steps,
then cosine decay to ``min_lr_ratio`` at the last step; built at a later step (a resumed run), the LRs of one built
at step 0 from there on. What the offload modes' chunk optimizers step with under it is tested in
tests/test_offload.py, what a resumed run steps with in tests/test_resume.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from moe_lab.optim.schedule import warmup_cosine

LR = 3e-3
# (steps, warmup): no warmup, a warmup of 1, warmup ending inside the run, just before its last step, at its end,
# and past it (a smoke run that stays in warmup); one-step and two-step runs.
CASES = [(1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (10, 0), (10, 1), (10, 3), (10, 9), (10, 10), (5, 8), (200, 20)]


def expected_factor(step: int, steps: int, warmup: int, min_lr_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, steps - warmup - 1)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def lrs_used(optimizer: torch.optim.Optimizer, scheduler, steps: int) -> list[list[float]]:
    """Each step's LR of every group, as optimizer.step() sees it, with the scheduler stepped after it."""
    out = []
    for _ in range(steps):
        out.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("min_lr_ratio", [0.1, 0.0])
@pytest.mark.parametrize("steps, warmup", CASES)
def test_warmup_cosine_gives_the_formulas_lr_at_every_step(steps, warmup, min_lr_ratio):
    params = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:]}], lr=LR)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler stepped before optimizer" or deprecated-epoch warning
        scheduler = warmup_cosine(optimizer, steps, warmup, min_lr_ratio)
        used = lrs_used(optimizer, scheduler, steps)
    for step, lrs in enumerate(used):
        want = LR * expected_factor(step, steps, warmup, min_lr_ratio)
        assert lrs == pytest.approx([want, want], rel=1e-12, abs=1e-15), f"step {step}"


def fresh_optimizer(**group_lrs) -> torch.optim.Optimizer:
    params = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    return torch.optim.SGD([{"params": params[:1], **group_lrs}, {"params": params[1:]}], lr=LR)


@pytest.mark.parametrize("steps, warmup", CASES)
def test_warmup_cosine_built_at_a_later_step_gives_the_lrs_from_there_bit_for_bit(steps, warmup):
    optimizer = fresh_optimizer()
    expected = lrs_used(optimizer, warmup_cosine(optimizer, steps, warmup, 0.1), steps)
    for start in range(steps + 1):  # steps: a resume from the last step's checkpoint, with nothing left to run
        optimizer = fresh_optimizer()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scheduler = warmup_cosine(optimizer, steps, warmup, 0.1, start_step=start)
            assert lrs_used(optimizer, scheduler, steps - start) == expected[start:], f"from step {start}"


def test_warmup_cosine_scales_each_groups_own_lr():
    optimizer = fresh_optimizer(lr=1.0)
    for step, lrs in enumerate(lrs_used(optimizer, warmup_cosine(optimizer, 10, 2, 0.1), 10)):
        factor = expected_factor(step, 10, 2, 0.1)
        assert lrs == pytest.approx([factor, LR * factor], rel=1e-12), f"step {step}"
