"""The sizes a plan is made of, from the model's config and the mesh alone: parameters per rank, FLOPs per step by
kind, rows each rank's experts receive. Nothing is built."""

from __future__ import annotations

from dataclasses import dataclass

from moe_lab.models.qwen3_moe import Qwen3MoeConfig


@dataclass(frozen=True)
class Mesh:
    """Ranks and how the model is split over them (``moe_lab.parallel.mesh``): ``dp_replicate`` replicas of
    ``shard`` consecutive ranks each; inside a replica dense weights sharded over its ``shard`` ranks, experts split
    over ``ep`` consecutive ranks and sharded over ``shard // ep``."""

    world: int
    gpus_per_node: int
    ep: int
    dp_replicate: int = 1

    @property
    def shard(self) -> int:
        """A replica's ranks (``dp_shard``): what FSDP2 shards over."""
        return self.world // self.dp_replicate

    @property
    def expert_shard(self) -> int:
        return self.shard // self.ep

    @property
    def nodes(self) -> int:
        return max(1, self.world // self.gpus_per_node)

    @property
    def ep_across_nodes(self) -> bool:
        """EP groups are consecutive ranks: they cross nodes only when wider than a node."""
        return self.ep > self.gpus_per_node

    @property
    def expert_shard_across_nodes(self) -> bool:
        """The ranks that shard the same experts sit ``ep`` apart in a replica: on other nodes unless the replica
        fits a node."""
        return self.expert_shard > 1 and self.shard > self.gpus_per_node

    @property
    def dense_across_nodes(self) -> bool:
        return self.shard > self.gpus_per_node

    @property
    def replicate_across_nodes(self) -> bool:
        """The ranks that hold the same shard sit ``shard`` apart: on other nodes whenever the job spans nodes."""
        return self.dp_replicate > 1 and self.world > self.gpus_per_node


@dataclass(frozen=True)
class Shapes:
    """Per-layer and outside-layer parameter counts of a Qwen3-MoE config (embedding, LM head, final norm)."""

    cfg: Qwen3MoeConfig

    @property
    def attention_params(self) -> int:
        c = self.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return c.hidden_size * (2 * q + 2 * kv) + 2 * c.head_dim

    @property
    def dense_layer_params(self) -> int:
        """A decoder layer's parameters that are not experts: attention, its norms, two layer norms, the router."""
        c = self.cfg
        return self.attention_params + 2 * c.hidden_size + c.num_experts * c.hidden_size

    @property
    def expert_params_per_expert(self) -> int:
        return 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size

    @property
    def expert_layer_params(self) -> int:
        return self.cfg.num_experts * self.expert_params_per_expert

    @property
    def embedding_params(self) -> int:
        return self.cfg.vocab_size * self.cfg.hidden_size

    @property
    def outside_params(self) -> int:
        """Embedding, LM head (untied) and the final norm."""
        return 2 * self.embedding_params + self.cfg.hidden_size

    @property
    def total_params(self) -> int:
        return self.outside_params + self.cfg.num_layers * (self.dense_layer_params + self.expert_layer_params)

    def local_params(self, mesh: Mesh) -> float:
        """Parameters one rank holds: every weight is split over a replica's ranks (experts by EP, then sharded)."""
        return self.total_params / mesh.shard

    def layer_params_unsharded(self, mesh: Mesh) -> int:
        """One decoder block as FSDP gathers it on a rank: its dense weights and the rank's EP share of experts."""
        return self.dense_layer_params + self.expert_layer_params // mesh.ep

    # FLOPs of one micro-batch's forward, per rank, by kind (multiply by 3 for forward + backward).
    def dense_flops(self, tokens: int) -> float:
        """Attention projections and the router, per layer, and the LM head."""
        return self.layer_dense_flops(tokens) + 2 * self.embedding_params * tokens

    def layer_dense_flops(self, tokens: int) -> float:
        return self.cfg.num_layers * 2 * (self.attention_params + self.cfg.num_experts * self.cfg.hidden_size) * tokens

    def expert_flops(self, tokens: int) -> float:
        """The SwiGLU experts on every routed (token, k) slot (balanced routing: each rank computes as many rows as
        it routes)."""
        return self.cfg.num_layers * 2 * self.cfg.num_experts_per_tok * self.expert_params_per_expert * tokens

    def attention_flops(self, tokens: int, seq_len: int) -> float:
        """Causal attention as executed (half the dense score and value matmuls)."""
        c = self.cfg
        return c.num_layers * 2 * seq_len * c.num_heads * c.head_dim * tokens
