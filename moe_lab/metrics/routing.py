"""How evenly the routers spread tokens over the experts: per layer and step, tokens per expert, the busiest expert's
load over the mean, the busiest EP rank's share and the router's entropy.

Each step's routing statistics (``moe_lab.moe.router.routing_stats``, [L, 2E + 1], on the device) are summed on the
device; they are summed over the ranks (the global batch) and read from the device only at a logging step, every
``trainer.expert_load_every`` steps and at the last, so recording adds no host sync to the other steps.
"""

from __future__ import annotations

import torch

from moe_lab.moe.router import split_stats
from moe_lab.runtime.host_read import summed_over_ranks, to_host


def describe(stats: torch.Tensor, top_k: int, ep: int) -> dict:
    """Per layer of routing statistics [L, 2E + 1] (summed over any number of steps and ranks): ``tokens`` per
    expert, ``max_over_mean`` (the busiest expert's tokens over the mean: 1 is balanced), ``busiest_ep_rank_share``
    (the share of the routed tokens that the EP rank holding the most of them computes: 1 / ep is balanced) and
    ``entropy`` (the router's mean entropy per token, nats; ln E is uniform)."""
    counts, _, entropy = split_stats(stats.double())
    per_rank = counts.reshape(counts.shape[0], ep, -1).sum(dim=-1)
    routed = counts.sum(dim=-1)
    return {
        "tokens": counts.round().long().tolist(),
        "max_over_mean": (counts.max(dim=-1).values / counts.mean(dim=-1)).tolist(),
        "busiest_ep_rank_share": (per_rank.max(dim=-1).values / routed).tolist(),
        "entropy": (entropy / (routed / top_k)).tolist(),
    }


class ExpertLoad:
    """Collects every step's routing statistics; ``add`` returns the metrics-row fields of a logging step.

    ``total``: this rank's share of the run's statistics, summed on the device; a resumed run starts from its
    checkpoint's (``Progress.expert_load``), so the summary covers the whole run."""

    def __init__(self, top_k: int, ep: int, every: int, steps: int, total: torch.Tensor | None = None):
        self.top_k, self.ep, self.every, self.last = top_k, ep, every, steps - 1
        self.total = total

    def add(self, step: int, stats: torch.Tensor, balance_loss: torch.Tensor | float) -> dict:
        """The step's statistics [L, 2E + 1] and balancing loss; at a logging step, ``expert_load`` (``describe``
        of the step's global batch) and ``balance_loss`` (this rank's), else nothing."""
        stats = stats.detach()
        self.total = stats.double() if self.total is None else self.total + stats
        if not self.every or (step % self.every and step != self.last):
            return {}
        row = {"expert_load": describe(summed_over_ranks(stats), self.top_k, self.ep)}
        if isinstance(balance_loss, torch.Tensor):
            row["balance_loss"] = to_host(balance_loss).item()
        return row

    def summary(self) -> dict:
        """The run's load: ``expert_load`` per layer (``describe`` of the whole run's tokens) and, averaged over
        layers, ``expert_load_max_over_mean``, ``busiest_ep_rank_share`` and ``router_entropy``."""
        if self.total is None:
            return {}
        run = describe(summed_over_ranks(self.total), self.top_k, self.ep)
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        return {
            "expert_load": run,
            "expert_load_max_over_mean": mean(run["max_over_mean"]),
            "busiest_ep_rank_share": mean(run["busiest_ep_rank_share"]),
            "router_entropy": mean(run["entropy"]),
        }
