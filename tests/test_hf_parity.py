"""Logits parity with transformers' Qwen3MoeForCausalLM (issue 2, acceptance 5): a tiny random Hugging Face model,
saved sharded (so the index path is exercised) in the published per-expert layout, loaded through the training
path (meta init -> to_empty -> load_hf_checkpoint), gives the same fp32 logits; and the reverse, our checkpoint
writer read back by transformers."""

from __future__ import annotations

import json

import pytest
import torch

from moe_lab.models.checkpoint import INDEX, load_hf_checkpoint, save_hf_checkpoint
from moe_lab.models.qwen3_moe import Qwen3MoeConfig

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def hf_config(norm_topk_prob: bool):
    return transformers.Qwen3MoeConfig(
        vocab_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, rope_theta=10_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **SHAPE,
    )


def our_config(hf) -> Qwen3MoeConfig:
    return Qwen3MoeConfig.preset(
        "tiny",
        name="hf-tiny", vocab_size=hf.vocab_size, num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, norm_topk_prob=hf.norm_topk_prob, rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings, rope_theta=10_000.0, **SHAPE,
    )


def random_hf_model(norm_topk_prob: bool):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(hf_config(norm_topk_prob)).eval()
    with torch.no_grad():  # norms away from 1 and a sharp router, so every weight and the routing matter
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.2 * torch.randn_like(p))
    return model


def input_ids():
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def load_ours(cfg: Qwen3MoeConfig, directory) -> torch.nn.Module:
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device="cpu")
    load_hf_checkpoint(model, directory)
    return model.eval()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_match_transformers(norm_topk_prob, tmp_path):
    hf = random_hf_model(norm_topk_prob)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1  # really sharded
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in weight_map  # the published per-expert layout
    ours = load_ours(our_config(hf.config), tmp_path)
    ids = input_ids()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids).logits
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_our_checkpoint_loads_in_transformers(tmp_path):
    hf = random_hf_model(True)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    ours = load_ours(our_config(hf.config), tmp_path / "hf")
    save_hf_checkpoint(ours.state_dict(), tmp_path / "ours")
    hf.config.save_pretrained(tmp_path / "ours")
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = input_ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, rtol=1e-6, atol=1e-6)
