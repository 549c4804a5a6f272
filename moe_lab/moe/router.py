"""The MoE router: which experts each token goes to, and with what weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Linear router -> fp32 softmax over all experts -> top-k -> optional renormalisation.

    ``routing`` replaces the router's choice of experts for experiments (the weights still come from the router's
    probabilities, so it keeps its gradient): ``balanced`` is the forced round-robin of the published benchmarks,
    ``skewed`` draws experts from a Zipf-like law with exponent ``routing_skew``. Both are deterministic functions of
    the token index, so activation recompute sees exactly the same routing.
    """

    # The routing decision: ac=selective keeps it, so recompute never re-routes (``moe_lab.parallel.parallelize``).
    saved_ops = frozenset({torch.ops.aten.topk.default})

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool,
        routing: str = "learned",
        routing_skew: float = 1.2,
        seed: int = 0,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.routing, self.routing_skew, self.seed = routing, routing_skew, seed

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        if self.routing == "learned":
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            ids = self.forced_ids(x.shape[0], x.device)
            weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forced_ids(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """Experts chosen for the experiment, not by the router: a pure function of (token index, layer seed),
        built from tensor ops alone so recompute sees the same routing and torch.compile traces it."""
        if self.routing == "balanced":
            ids = torch.arange(num_tokens * self.top_k, device=device) % self.num_experts
            return ids.view(num_tokens, self.top_k)
        # Gumbel-top-k: K distinct experts per token drawn with probability proportional to (e + 1) ** -skew, the
        # uniforms coming from an integer hash of (token, expert, seed) instead of a random generator.
        log_law = -self.routing_skew * torch.log(torch.arange(1, self.num_experts + 1, device=device, dtype=torch.float32))
        gumbel = -torch.log(-torch.log(self.hashed_uniforms(num_tokens, device)))
        return torch.topk(log_law + gumbel, self.top_k, dim=-1).indices

    def hashed_uniforms(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """(num_tokens, num_experts) uniforms in (0, 1) from 24 hashed bits each: exact in float32, so they are
        the same on every device and backend (the logs after them may differ in the last bit)."""
        slot = torch.arange(num_tokens * self.num_experts, device=device, dtype=torch.int64)
        return (_hash32(slot, self.seed) >> 8).float().add_(0.5).div_(2.0**24).view(num_tokens, self.num_experts)


def _hash32(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A 32-bit integer mixing hash (int64 arithmetic, no overflow): uniform-looking bits from consecutive ints.
    The seed is XORed in first, as an int64 tensor: Inductor (torch 2.11) folds multiply-adds on an arange into an
    int32 index expression, where 32-bit constants do not fit, and types a symbolic int seed (each layer has its own,
    so compile makes it dynamic) as float32 in a bitwise op."""
    seed_bits = torch.full((), ((seed + 1) * 0x85EBCA77) & 0xFFFFFFFF, dtype=torch.int64, device=x.device)
    x = ((x ^ seed_bits) * 0x9E3779B1) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
    return (x >> 16) ^ x
