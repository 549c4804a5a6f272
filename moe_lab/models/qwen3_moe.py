"""Qwen3-MoE decoder, readable top to bottom.

Parameter names follow Hugging Face's ``Qwen3MoeForCausalLM`` (transformers 5 layout, experts stored as stacked
``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]) so checkpoints map one to one. The model knows nothing of
process groups: each MoE block hands its tokens, their routing and its experts' weights to its ``dispatcher``, which
parallelism code replaces from outside (``moe_lab.parallel``).

Packed documents (``Documents``): attention stays inside each document (on a GPU a FlexAttention block mask, on the
CPU a dense SDPA mask) and RoPE positions restart at each document's first token, so a packed sample computes what
each document would alone.
Every forward also returns each layer's routing statistics (``moe_lab.moe.router.routing_stats``), from which the
trainer adds the balancing loss and logs the experts' load.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, astuple, dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
import torch.nn.functional as F
import yaml
from einops import rearrange
from torch import nn
from torch.profiler import record_function

from moe_lab.models.hf_config import check_agrees
from moe_lab.models.init import fill_normal_rows
from moe_lab.models.loss import LanguageModelLoss
from moe_lab.moe.dispatcher import TokenDispatcher, TorchDispatcher
from moe_lab.moe.experts import GroupedExperts
from moe_lab.moe.router import AuxLoss, ExpertBias, NoBalance, Router, RouterBalance
from moe_lab.runtime.paths import CONF_DIR

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MODEL_CONFIGS = CONF_DIR / "model"


@dataclass
class Qwen3MoeConfig:
    """Shape of a Qwen3-MoE model; ``num_layers`` below the published depth builds a proxy with the same layers.
    No field has a default: the values live once, in the ``model`` group's files (conf/model/*.yaml), which
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
    # How the learned routers are kept balanced: not at all, Qwen3-MoE's auxiliary loss (weighted by
    # router_aux_loss_coef, as in its config.json), or a per-expert selection bias moved by router_bias_update_rate
    # after every step (auxiliary-loss-free, DeepSeek-V3).
    router_balance: Literal["none", "aux_loss", "bias"]
    router_aux_loss_coef: float
    router_bias_update_rate: float

    @classmethod
    def preset(cls, option: str, /, **overrides) -> Qwen3MoeConfig:
        """The ``model=<option>`` config (tiny, qwen3_30b, qwen3_235b) with ``overrides``, e.g. ``num_layers=4``."""
        values = yaml.safe_load((MODEL_CONFIGS / f"{option}.yaml").read_text())
        values.pop("_target_")
        return cls(**(values | overrides))

    def build(self) -> Qwen3MoeForCausalLM:
        return Qwen3MoeForCausalLM(self)

    def balance(self) -> RouterBalance:
        """What keeps the routers balanced in training: the loss term and the update between steps."""
        if self.router_balance == "aux_loss":
            return AuxLoss(self.router_aux_loss_coef, self.num_experts_per_tok)
        if self.router_balance == "bias":
            return ExpertBias(self.router_bias_update_rate)
        return NoBalance()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class HfQwen3MoeConfig(Qwen3MoeConfig):
    """``model=hf``: the shape of a Hugging Face Qwen3-MoE checkpoint, read from ``path``/config.json by the option's
    interpolations (``conf/model/hf.yaml``). A value set by an override that contradicts the file (any key
    of ``moe_lab.models.hf_config.ARCHITECTURE``) is refused, naming the key; ``num_layers`` may cut a proxy."""

    path: str

    def __post_init__(self):
        check_agrees(self.to_dict(), self.path, "model.path")


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


class Documents(NamedTuple):
    """Where the documents packed into a batch lie: ``ids`` [B, S] numbers each sample's documents (a token attends
    only to earlier tokens of its own document), ``positions`` [B, S] counts each document's tokens from 0 (RoPE)."""

    ids: torch.Tensor
    positions: torch.Tensor

    def to(self, device: torch.device) -> Documents:
        return Documents(self.ids.to(device, non_blocking=True), self.positions.to(device, non_blocking=True))

    def attention_mask(self) -> torch.Tensor | BlockMask:
        """Causal attention inside each document: on a GPU a FlexAttention block mask (its compiled kernel skips
        the blocks across documents), elsewhere a dense boolean mask [B, 1, S, S] for SDPA (FlexAttention has no
        CPU backward)."""
        ids = self.ids
        batch, seq = ids.shape
        if not ids.is_cuda:
            causal = torch.ones(seq, seq, dtype=torch.bool, device=ids.device).tril()
            return ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & causal).unsqueeze(1)
        # FlexAttention imports the compiler (seconds): only runs that pack documents on a GPU import it.
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document_causal(b, h, q, kv):
            return (ids[b, q] == ids[b, kv]) & (q >= kv)

        return create_block_mask(same_document_causal, batch, None, seq, seq, device=ids.device, _compile=True)


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, S, vocab]; None where the forward was given a loss
    router_stats: torch.Tensor  # [L, 2E + 1]: each layer's routing statistics (moe_lab.moe.router.routing_stats)
    loss: torch.Tensor | None = None  # the loss's value of the labels (a forward given labels and a loss)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., S, head_dim] for token positions [..., S]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | None
) -> torch.Tensor:
    """Causal attention over the whole sample (``mask`` None) or inside each document (``Documents.attention_mask``:
    a dense mask for SDPA, or a block mask for FlexAttention). FlexAttention is fast only compiled (eager, it
    materialises every score): it runs compiled by the compiled block it is part of, or else on its own (as
    torchtitan does)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    from torch.nn.attention.flex_attention import flex_attention

    attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return attend(q, k, v, block_mask=mask, enable_gqa=True)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | BlockMask | None
    ) -> torch.Tensor:
        # x [B, S, hidden] -> per-head q [B, heads, S, D], k and v [B, kv_heads, S, D]; q/k norms act on D.
        q = self.q_norm(rearrange(self.q_proj(x), "b s (h d) -> b h s d", d=self.head_dim))
        k = self.k_norm(rearrange(self.k_proj(x), "b s (h d) -> b h s d", d=self.head_dim))
        v = rearrange(self.v_proj(x), "b s (h d) -> b h s d", d=self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention(q, k, v, mask)
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
            balance=cfg.router_balance,
        )
        self.experts = GroupedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.dispatcher: TokenDispatcher = TorchDispatcher()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the block's output, shaped as x, and its routing statistics [2E + 1]."""
        tokens = x.reshape(-1, x.shape[-1])  # [B, S, H] (or any leading dims) -> [T, H]
        topk_ids, topk_weights, stats = self.gate(tokens)
        # The experts' weights are read here, in the block's forward, after the block's FSDP pre-forward hook has
        # gathered them (moe_lab.parallel.fsdp moves the experts' hooks to the block).
        with record_function("moe_lab::dispatch"):  # what is not GEMM or all-to-all in here is dispatch glue
            y = self.dispatcher(tokens, topk_ids, topk_weights, self.experts.gate_up_proj, self.experts.down_proj)
        return y.view(x.shape), stats


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg, layer_idx)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | BlockMask | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        y, stats = self.mlp(self.post_attention_layernorm(x))
        return x + y, stats


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta

    def forward(self, input_ids: torch.Tensor, documents: Documents | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> final hidden states [B, S, hidden] and the layers' routing statistics [L, 2E + 1]."""
        x = self.embed_tokens(input_ids)
        if documents is None:  # one sequence per sample: positions 0..S-1, [S, D] broadcast over batch and heads
            positions, mask = torch.arange(input_ids.shape[1], device=input_ids.device), None
        else:  # [B, 1, S, D]: each document's own positions
            positions, mask = documents.positions.unsqueeze(1), documents.attention_mask()
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        stats = []
        for layer in self.layers:
            x, layer_stats = layer(x, cos, sin, mask)
            stats.append(layer_stats)
        return self.norm(x), torch.stack(stats)


class LMHead(nn.Linear):
    """The LM head: the logits of the hidden states, or, given labels and a loss (``moe_lab.models.loss``), the
    loss, which computes the logits as it sees fit (a chunked loss never holds them all). Either way the head's
    weight is read in its own call, where hooks on the head (FSDP2's gather) have run."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(
        self, hidden: torch.Tensor, labels: torch.Tensor | None = None, loss: LanguageModelLoss | None = None
    ) -> torch.Tensor:
        return super().forward(hidden) if loss is None else loss(hidden, self.weight, labels)


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        documents: Documents | None = None,
        labels: torch.Tensor | None = None,
        loss: LanguageModelLoss | None = None,
    ) -> CausalLMOutput:
        """-> the logits, or given ``labels`` and a ``loss``, the loss's value of them (no logits), and the
        layers' routing statistics."""
        hidden, router_stats = self.model(input_ids, documents)
        if loss is None:
            return CausalLMOutput(self.lm_head(hidden), router_stats)
        return CausalLMOutput(None, router_stats, self.lm_head(hidden, labels, loss))

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

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Training state that is no weight (the routers' selection biases) at its start, after ``to_empty``
        (weights come from ``init_weights`` or a checkpoint)."""
        for module in self.modules():
            if isinstance(module, Router):
                module.init_buffers()


_COUNTS: dict[tuple, tuple[int, int]] = {}


def count_parameters(cfg: Qwen3MoeConfig) -> tuple[int, int]:
    """(total, active) parameter counts, embeddings included, as model cards report them. Builds on meta, once per
    config in a process (``python -m moe_lab.tune`` plans thousands of points of one model: the build was most of
    each plan's time)."""
    key = (type(cfg), astuple(cfg))
    if key not in _COUNTS:
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(cfg)
        total = sum(p.numel() for p in model.parameters())
        expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        _COUNTS[key] = total, total - expert_params + expert_params * cfg.num_experts_per_tok // cfg.num_experts
    return _COUNTS[key]
