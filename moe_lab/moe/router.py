"""The MoE router: which experts each token goes to, and with what weight; what that routing looked like (its
statistics); and how routers are kept balanced (``model.router_balance``)."""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    """Linear router -> fp32 softmax over all experts -> top-k -> optional renormalisation; returns the experts, their
    weights and the layer's routing statistics (``routing_stats``).

    ``balance="bias"`` adds a per-expert bias (buffer ``expert_bias``, moved by ``ExpertBias.update`` between steps)
    to the probabilities for the choice of experts only: the weights stay the router's probabilities.

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
        balance: str = "none",
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.routing, self.routing_skew, self.seed = routing, routing_skew, seed
        # balance="bias" only: training state, saved with the model, zero at the start (init_buffers)
        self.register_buffer("expert_bias", torch.zeros(num_experts) if balance == "bias" else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> expert ids [T, K], weights [T, K] in x's dtype, routing statistics [2E + 1] (fp32)."""
        probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
        if self.routing != "learned":
            ids = self.forced_ids(x.shape[0], x.device)
        elif self.expert_bias is not None:
            ids = torch.topk(probs + self.expert_bias, self.top_k, dim=-1).indices
        else:
            ids = torch.topk(probs, self.top_k, dim=-1).indices
        weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype), routing_stats(probs, ids)

    @torch.no_grad()
    def init_buffers(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forced_ids(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """Experts chosen for the experiment, not by the router: a pure function of (token index, layer seed),
        built from tensor ops alone so recompute sees the same routing and torch.compile traces it."""
        if self.routing == "balanced":
            ids = torch.arange(num_tokens * self.top_k, device=device) % self.num_experts
            return ids.view(num_tokens, self.top_k)
        # Gumbel-top-k: K distinct experts per token drawn with probability proportional to (e + 1) ** -skew, the
        # uniforms coming from an integer hash of (token, expert, seed) instead of a random generator.
        log_law = -self.routing_skew * torch.log(
            torch.arange(1, self.num_experts + 1, device=device, dtype=torch.float32)
        )
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


# One layer's routing statistics of one forward, a flat fp32 vector [2E + 1] so that a compiled block returns one
# tensor and a step's layers stack into one [L, 2E + 1] (read from the host once per logging interval):
#   [0, E)   tokens per expert (each token counts once for each of its K experts)
#   [E, 2E)  the router's probability of each expert, summed over tokens (differentiable: the auxiliary loss)
#   2E       the router's entropy (nats), summed over tokens
def routing_stats(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Statistics of routing ``probs`` [T, E] (fp32) to experts ``ids`` [T, K], with no host sync: counts by
    scatter-add into a fixed [E] (bincount would read the largest id back to size its output)."""
    num_experts = probs.shape[-1]
    counts = torch.zeros(num_experts, device=probs.device, dtype=torch.float32).scatter_add_(
        0, ids.reshape(-1), torch.ones(ids.numel(), device=probs.device, dtype=torch.float32)
    )
    entropy = torch.special.entr(probs).sum().reshape(1)
    return torch.cat([counts, probs.sum(dim=0), entropy])


def split_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens per expert [..., E], summed probabilities [..., E], summed entropy [...]) of ``routing_stats``
    vectors (stacked along leading dimensions)."""
    num_experts = (stats.shape[-1] - 1) // 2
    return stats[..., :num_experts], stats[..., num_experts : 2 * num_experts], stats[..., 2 * num_experts]


class RouterBalance(abc.ABC):
    """How routers are kept balanced (``model.router_balance``): a term for the loss, computed from a step's routing
    statistics [L, 2E + 1], and an update of the routers after the optimizer step."""

    @abc.abstractmethod
    def loss(self, stats: torch.Tensor) -> torch.Tensor | float: ...

    def update(self, model: nn.Module, stats: torch.Tensor) -> None:  # noqa: B027 (most balances update nothing)
        pass


class NoBalance(RouterBalance):
    """Nothing keeps the experts' load even."""

    def loss(self, stats: torch.Tensor) -> float:
        return 0.0


class AuxLoss(RouterBalance):
    """Qwen3-MoE's (Switch Transformer's) load-balancing loss, pooled over the layers as transformers computes it
    (``load_balancing_loss_func``): coef * E * sum_e f_e * P_e, with f_e the share of the K * tokens routings that
    went to expert e (summed over k) and P_e the mean router probability of e.

    f_e counts the whole global batch (summed over the ranks; it carries no gradient) and P_e this rank's tokens, so
    the ranks' gradients average to the one-rank gradient of the global batch: every mesh shape trains alike, and
    on one rank this is transformers' value. (transformers counts each device's tokens alone.)"""

    def __init__(self, coef: float, top_k: int):
        self.coef, self.top_k = coef, top_k

    def loss(self, stats: torch.Tensor) -> torch.Tensor:
        counts, prob_sums, _ = split_stats(stats)  # [L, E] each
        local_rows = counts.sum().detach() / self.top_k  # tokens of all layers: each routed K times
        global_counts = counts.detach().sum(dim=0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            global_counts = global_counts.clone()
            dist.all_reduce(global_counts)
        tokens_per_expert = global_counts / (global_counts.sum() / self.top_k)
        router_prob_per_expert = prob_sums.sum(dim=0) / local_rows
        return self.coef * counts.shape[-1] * torch.sum(tokens_per_expert * router_prob_per_expert)


class ExpertBias(RouterBalance):
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step every router's ``expert_bias`` moves by
    ``rate`` towards the mean load, up for an expert below it and down above it, from the load of the whole global
    batch (summed over every rank, so the bias stays the same everywhere). The bias changes which experts are chosen,
    never their weights, and adds nothing to the loss."""

    def __init__(self, rate: float):
        self.rate = rate

    def loss(self, stats: torch.Tensor) -> float:
        return 0.0

    @torch.no_grad()
    def update(self, model: nn.Module, stats: torch.Tensor) -> None:
        counts = split_stats(stats.detach())[0].clone()  # [L, E]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        routers = [m for m in model.modules() if isinstance(m, Router)]
        for router, load in zip(routers, counts, strict=True):
            router.expert_bias.add_(self.rate * torch.sign(load.mean() - load))
