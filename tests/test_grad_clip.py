"""Gradient clipping (``moe_lab.job.trainer.clip_grad_norm``) on one rank against torch's own
``clip_grad_norm_``: the global norm it returns and the gradients it leaves, clipping (max_norm under the norm) and
not (over it: the gradients untouched). The multi-rank tests compare meshes with this one rank
(tests/test_distributed_training.py), so this anchors them to an independent reference."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_lab.job.trainer import clip_grad_norm


@pytest.mark.parametrize("max_over_norm", [0.5, 2.0])
def test_clip_matches_torch(max_over_norm):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    reference = copy.deepcopy(model)
    for p, r in zip(model.parameters(), reference.parameters()):
        r.grad = p.grad.clone()  # (deepcopy leaves .grad behind)
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()
    max_norm = max_over_norm * norm

    returned = clip_grad_norm(model, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm).item()

    assert returned == pytest.approx(expected, rel=1e-6)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])).item()
    assert clipped == pytest.approx(min(max_norm, norm), rel=1e-5)
