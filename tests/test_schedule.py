"""warmup_cosine (torch's LambdaLR) against the schedule written out here: linear warmup to 1 over ``warmup`` steps,
then cosine decay to ``min_lr_ratio`` at the last step; built at a later step (a resumed run), the LRs of one built
at step 0 from there on; held at ``min_lr_ratio`` past the last step; scaling the LR the group has when it is built;
refusing steps < 1 and negative warmups or starts. What the offload modes' chunk optimizers step with under it is
tested in tests/test_offload.py, what a resumed run steps with in tests/test_resume.py."""

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


@pytest.mark.parametrize("start", [0, 4])
def test_warmup_cosine_scales_the_lr_the_group_has_now_not_an_earlier_schedulers(start):
    """The base LR is the group's LR when the scheduler is built, also where an earlier scheduler on the same
    optimizer left its own base (torch's ``initial_lr``) behind."""
    optimizer = fresh_optimizer()
    warmup_cosine(optimizer, 10, 2, 0.1)  # an earlier schedule from LR
    for group in optimizer.param_groups:
        group["lr"] = 2 * LR
    used = lrs_used(optimizer, warmup_cosine(optimizer, 10, 2, 0.1, start_step=start), 10 - start)
    for step, lrs in enumerate(used, start=start):
        want = 2 * LR * expected_factor(step, 10, 2, 0.1)
        assert lrs == pytest.approx([want, want], rel=1e-12), f"step {step}"


@pytest.mark.parametrize("steps, warmup", [(steps, warmup) for steps, warmup in CASES if warmup < steps])
def test_warmup_cosine_holds_the_minimum_past_the_last_step(steps, warmup):
    """Past the last step (the scheduler's step after the run's last optimizer step, a scheduler built at a later
    step) the LR stays at ``lr * min_lr_ratio``: the cosine does not turn back up."""
    optimizer = fresh_optimizer()
    past = lrs_used(optimizer, warmup_cosine(optimizer, steps, warmup, 0.1), steps + 3)[steps:]
    for step, lrs in enumerate(past, start=steps):
        assert lrs == pytest.approx([LR * 0.1] * 2, rel=1e-12), f"step {step}"
    optimizer = fresh_optimizer()
    warmup_cosine(optimizer, steps, warmup, 0.1, start_step=steps + 5)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([LR * 0.1] * 2, rel=1e-12)


@pytest.mark.parametrize(
    "steps, warmup, start",
    [(0, 0, 0), (-1, 0, 0), (10, -1, 0), (10, 0, -1)],
    ids=["no_steps", "negative_steps", "negative_warmup", "negative_start"],
)
def test_warmup_cosine_refuses_a_schedule_it_cannot_run(steps, warmup, start):
    with pytest.raises(ValueError, match="steps >= 1, warmup_steps >= 0 and start_step >= 0"):
        warmup_cosine(fresh_optimizer(), steps, warmup, 0.1, start_step=start)
