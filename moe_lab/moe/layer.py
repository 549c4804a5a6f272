"""Router and expert weights of an MoE layer. Token movement is the dispatcher's job (``moe_lab.moe.dispatcher``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from moe_lab.moe.dispatcher import TorchDispatcher


class Router(nn.Module):
    """Linear router -> fp32 softmax over all experts -> top-k -> optional renormalisation.

    ``routing`` replaces the router's choice of experts for experiments (the weights still come from the router's
    probabilities, so it keeps its gradient): ``balanced`` is the forced round-robin of the published benchmarks,
    ``skewed`` draws experts from a Zipf-like law with exponent ``routing_skew``. Both are deterministic functions of
    the token index, so activation recompute sees exactly the same routing.
    """

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


class GroupedExperts(nn.Module):
    """SwiGLU experts stored as stacked tensors; holds only the experts its rank owns once parallelised.

    ``dispatcher`` moves tokens to the experts and back. It is set from outside (``moe_lab.parallel``); the default
    is the torch dispatcher without a process group, i.e. all experts local.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts  # global count; the parameters may hold a slice of them
        self.expert_offset = 0  # index of the first expert held here (set by expert parallelism)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.dispatcher = TorchDispatcher()

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    # Profiler scopes are entered inside the methods, not as decorators: torch.compile (before torch 2.13) traces a
    # record_function only when it is created in the compiled code.
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        with record_function("moe_lab::dispatch"):  # what is not GEMM or all-to-all in here is dispatch glue
            return self.dispatcher(x, topk_ids, topk_weights, self)

    def compute(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Expert-contiguous rows in, expert outputs out: grouped GEMM -> SwiGLU -> grouped GEMM."""
        with record_function("moe_lab::expert_compute"):
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
            x = x.to(dtype)
            gate_up = torch._grouped_mm(x, self.gate_up_proj.to(dtype).transpose(-2, -1), offs=offsets)
            gate, up = gate_up.chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, self.down_proj.to(dtype).transpose(-2, -1), offs=offsets)
