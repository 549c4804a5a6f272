"""The FP8 expert weight copies follow every optimizer step: the FP8 forward after step N uses step N's weights, for
every optimizer and offload mode (``moe_lab.moe.fp8.weights``; fused AdamW updates parameters without bumping their
version counter, which once let FP8 experts train on stale copies)."""

from __future__ import annotations

import pytest
import torch

from moe_lab import config
from moe_lab.job.trainer import train
from moe_lab.moe.fp8 import weights
from moe_lab.optim.optimizers import SignSGD
from tests.configs import TINY, compose_train

OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
    "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=0.1, foreach=False),
    "signsgd": lambda p: SignSGD(p, lr=0.1),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same_copy(a, b) -> bool:
    return all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_copy_after_a_step_is_the_stepped_weights(name, device):
    w = torch.nn.Parameter(torch.randn(2, 128, 128, device=device))
    optimizer = OPTIMIZERS[name]([w])
    before = torch.ops.moe_lab.fp8_expert_weights(w)
    w.grad = torch.randn_like(w)
    optimizer.step()
    after = torch.ops.moe_lab.fp8_expert_weights(w)
    assert not _same_copy(after, before)
    assert _same_copy(after, weights.quantize_expert_stack(w.detach()))
    again = torch.ops.moe_lab.fp8_expert_weights(w)  # no step between: the copy is reused
    assert all(a is b for a, b in zip(again, after))


class _NeverHit(dict):
    """A cache that never hits: every call quantizes the parameter as it is now (the reference)."""

    def get(self, key, default=None):
        return None


# The tiny model at FP8's 128-wide tiles; FP8 experts on the CPU run the reference emulation.
FP8_TINY = TINY + [
    "model.hidden_size=128",
    "model.moe_intermediate_size=128",
    "model.head_dim=32",
    "dispatcher.expert_precision=fp8",
    "trainer.steps=3",
    "optimizer.lr=0.01",
]


@pytest.mark.parametrize(
    "overrides",
    [
        ["dispatcher=fused", "dispatcher.backend=reference"],  # fused AdamW, the default
        ["dispatcher=fused", "dispatcher.backend=reference", "optimizer.fused=false"],
        ["dispatcher=fused", "dispatcher.backend=reference", "optimizer=signsgd"],
        ["dispatcher=fused", "dispatcher.backend=reference", "offload=optimizer"],  # steps inside the last backward
        ["dispatcher=fused", "dispatcher.backend=reference", "offload=full"],
        ["dispatcher=fused", "dispatcher.backend=reference", "trainer.grad_accum=2"],
        ["dispatcher=torch"],
    ],
    ids=["adamw_fused", "adamw_foreach", "signsgd", "offload_optimizer", "offload_full", "grad_accum", "torch"],
)
def test_training_losses_equal_those_of_copies_made_every_call(overrides, tmp_path, monkeypatch):
    cfg = compose_train(*FP8_TINY, *overrides)

    def losses(run_dir):
        return train(cfg, config.validate(cfg), run_dir, torch.device("cpu"), 0, 1)["losses"]

    cached = losses(tmp_path / "cached")
    monkeypatch.setattr(weights, "_CACHE", _NeverHit())
    assert cached == losses(tmp_path / "uncached")
