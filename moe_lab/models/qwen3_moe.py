"""Qwen3-MoE decoder, readable top to bottom.

Parameter names follow Hugging Face's ``Qwen3MoeForCausalLM`` (transformers 5 layout, experts stored as stacked
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]) so checkpoints map one to one. The model knows nothing of
process groups: each MoE block hands its tokens, their routing and its experts' weights to its ``dispatcher``, which
parallelism code replaces from outside (``moe_lab.parallel``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
import yaml
from einops import rearrange
from torch import nn
from torch.profiler import record_function

from moe_lab.models.init import fill_normal_rows
from moe_lab.moe.dispatcher import TokenDispatcher, TorchDispatcher
from moe_lab.moe.experts import GroupedExperts
from moe_lab.moe.router import Router

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "conf" / "model"


@dataclass
class Qwen3MoeConfig:
    """Shape of a Qwen3-MoE model; ``num_layers`` below the published depth builds a proxy with the same layers.
    No field has a default: the values live once, in the ``model`` group's files (moe_lab/conf/model/*.yaml), which
    ``preset`` reads outside Hydra."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    init_std: float
    # How tokens pick experts: the router's choice, forced round-robin, or a Zipf-like load with this exponent.
    routing: Literal["learned", "balanced", "skewed"]
    routing_skew: float

    @classmethod
    def preset(cls, option: str, /, **overrides) -> "Qwen3MoeConfig":
        """The ``model=<option>`` config (tiny, qwen3_30b, qwen3_235b) with ``overrides``, e.g. ``num_layers=4``."""
        values = yaml.safe_load((MODEL_CONFIGS / f"{option}.yaml").read_text())
        values.pop("_target_")
        return cls(**(values | overrides))

    def build(self) -> "Qwen3MoeForCausalLM":
        return Qwen3MoeForCausalLM(self)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, S, D]; the rotate-half convention of Qwen3 / Hugging Face.
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x [B, S, hidden] -> per-head q [B, heads, S, D], k and v [B, kv_heads, S, D]; q/k norms act on D.
        q = self.q_norm(rearrange(self.q_proj(x), "b s (h d) -> b h s d", d=self.head_dim))
        k = self.k_norm(rearrange(self.k_proj(x), "b s (h d) -> b h s d", d=self.head_dim))
        v = rearrange(self.v_proj(x), "b s (h d) -> b h s d", d=self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))


class SparseMoeBlock(nn.Module):
    """Router -> top-k experts per token -> the dispatcher, which runs the block's experts on the tokens routed to
    them (wherever those experts live) and returns each token's weighted sum of its experts' outputs.

    ``dispatcher`` defaults to the torch dispatcher without a process group: every expert local.
    """

    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int):
        super().__init__()
        self.gate = Router(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            norm_topk_prob=cfg.norm_topk_prob,
            routing=cfg.routing,
            routing_skew=cfg.routing_skew,
            seed=layer_idx,
        )
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.dispatcher: TokenDispatcher = TorchDispatcher()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [B, S, H] (or any leading dims) -> [T, H]
        topk_ids, topk_weights = self.gate(tokens)
        # The experts' weights are read here, in the block's forward, after the block's FSDP pre-forward hook has
        # gathered them (moe_lab.parallel.fsdp moves the experts' hooks to the block).
        with record_function("moe_lab::dispatch"):  # what is not GEMM or all-to-all in here is dispatch glue
            y = self.dispatcher(tokens, topk_ids, topk_weights, self.experts.gate_up_proj, self.experts.down_proj)
        return y.view(x.shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, layer_idx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(input_ids.shape[1], self.head_dim, self.rope_theta, input_ids.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))

    @torch.no_grad()
    def init_weights(self, seed: int = 0, shards: dict[str, tuple[torch.Tensor, int]] | None = None) -> None:
        """Normal(0, init_std) for matrices, ones for norms; output projections scaled by depth (GPT-2 style).
        Values are a function of (seed, parameter name, row) alone (``moe_lab.models.init``). ``shards``: what to
        fill, by parameter name, as (tensor, index of its first row in the whole parameter); by default each
        parameter itself (a caller that has split the parameters passes the pieces it holds)."""
        out_std = self.config.init_std / math.sqrt(2 * self.config.num_layers)
        if shards is None:
            shards = {name: (p, 0) for name, p in self.named_parameters()}
        for name, (tensor, first_row) in shards.items():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                std = out_std if name.endswith(("o_proj.weight", "down_proj")) else self.config.init_std
                fill_normal_rows(tensor, std, seed=seed, name=name, first_row=first_row)


def count_parameters(cfg: Qwen3MoeConfig) -> tuple[int, int]:
    """(total, active) parameter counts, embeddings included, as model cards report them. Builds on meta."""
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert_params + expert_params * cfg.num_experts_per_tok // cfg.num_experts
    return total, active
