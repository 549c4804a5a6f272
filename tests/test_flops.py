"""FLOPs per token (``moe_lab.metrics.flops.flops_per_token``), which MFU divides by, against the formula torchtitan
and prime-rl state, worked out by hand from the model card's shapes: 6 x the active weights a token multiplies by
(every layer's attention projections, router and top-k experts, and the LM head; the embedding is a lookup) plus
causal attention's 12 x layers x heads x head_dim x seq, counted dense ("shared") or halved as a causal kernel runs it
("executed")."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from moe_lab.metrics.flops import flops_per_token
from moe_lab.runtime.paths import CONF_DIR


@pytest.mark.parametrize("seq_len", [4096, 16384])
def test_qwen3_30b_flops_per_token_by_hand(seq_len):
    hidden, layers, heads, kv_heads, head_dim = 2048, 48, 32, 4, 128
    experts, top_k, intermediate, vocab = 128, 8, 768, 151936
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    routed = hidden * experts + top_k * 3 * hidden * intermediate  # router; gate, up and down of K experts
    norms = 2 * hidden + 2 * head_dim  # the block's two RMSNorms, q_norm and k_norm
    weights = layers * (attention + routed + norms) + hidden + vocab * hidden  # final norm, LM head
    dense_attention = 12 * layers * heads * head_dim * seq_len

    cfg = instantiate(OmegaConf.load(CONF_DIR / "model" / "qwen3_30b.yaml"))
    flops = flops_per_token(cfg, seq_len)

    assert flops["shared"] == 6 * weights + dense_attention
    assert flops["executed"] == 6 * weights + dense_attention / 2
    assert 6 * weights == pytest.approx(6 * 3.04e9, rel=0.01)  # the card's 3.3B active, less the 0.31B embedding
