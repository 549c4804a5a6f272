"""Logits parity with transformers' Qwen3MoeForCausalLM (issue 2, acceptance 5): a tiny random Hugging Face model,
saved sharded (so the index path is exercised) in the published per-expert layout, loaded through the training
path (meta init -> to_empty -> load_hf_checkpoint), gives the same fp32 logits; and the reverse, our checkpoint
writer read back by transformers."""

from __future__ import annotations

import json

import pytest
import torch

from moe_lab.models.hf_weights import INDEX, load_hf_checkpoint, save_hf_checkpoint
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from tests.configs import compose_train

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def hf_config(norm_topk_prob: bool):
    return transformers.Qwen3MoeConfig(
        vocab_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=64,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **SHAPE,
    )


def our_config(hf) -> Qwen3MoeConfig:
    return Qwen3MoeConfig.preset(
        "tiny",
        name="hf-tiny",
        vocab_size=hf.vocab_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        norm_topk_prob=hf.norm_topk_prob,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        rope_theta=10_000.0,
        **SHAPE,
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


def test_aux_loss_equals_transformers(tmp_path):
    """router_balance=aux_loss on one rank is transformers' load_balancing_loss_func of the same routing."""
    from moe_lab.moe.router import AuxLoss

    hf = random_hf_model(True)
    hf.save_pretrained(tmp_path)
    ours = load_ours(our_config(hf.config), tmp_path)
    ids = input_ids()
    with torch.no_grad():
        expected = hf(ids, output_router_logits=True).aux_loss
        stats = ours(ids).router_stats
    coef = hf.config.router_aux_loss_coef
    torch.testing.assert_close(
        AuxLoss(coef, hf.config.num_experts_per_tok).loss(stats) / coef, expected, rtol=1e-5, atol=1e-7
    )


def compose_model(*overrides: str):
    return compose_train(*overrides)


def test_model_hf_reads_config_json_and_matches_transformers(tmp_path):
    """model=hf model.path=<dir> builds the model a Hugging Face checkpoint's config.json describes: its logits are
    transformers' (loaded by trainer.init_checkpoint's path), and model.num_layers=1 cuts a proxy."""
    from hydra.utils import instantiate

    from moe_lab import config

    hf = random_hf_model(False)
    hf.save_pretrained(tmp_path)
    cfg = compose_model("model=hf", f"model.path={tmp_path}", f"trainer.init_checkpoint={tmp_path}", "data.seq_len=32")
    options = config.validate(cfg)
    assert (
        options.model.num_experts == 8
        and options.model.norm_topk_prob is False
        and options.model.rope_theta == 10_000.0
    )
    assert options.model.router_aux_loss_coef == hf.config.router_aux_loss_coef
    ours = load_ours(options.model, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids()).logits, hf(input_ids()).logits, rtol=1e-5, atol=1e-5)
    proxy = instantiate(compose_model("model=hf", f"model.path={tmp_path}", "model.num_layers=1").model)
    assert proxy.num_layers == 1 and proxy.hidden_size == 32


# transformers 4's spelling of Qwen3-30B-A3B's config.json (as published) and transformers 5's, shortened (head_dim,
# which transformers 5's Qwen3MoeConfig does not declare, stays as the published file gives it)
TRANSFORMERS_4 = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "initializer_range": 0.02,
}
TRANSFORMERS_5 = {
    **{k: v for k, v in TRANSFORMERS_4.items() if k not in ("num_experts", "rope_theta", "rope_scaling")},
    "num_local_experts": 128,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}


def write_config(directory, values) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(values))
    return str(directory)


@pytest.mark.parametrize("spelling", [TRANSFORMERS_4, TRANSFORMERS_5], ids=["transformers4", "transformers5"])
def test_both_spellings_give_the_published_model(spelling, tmp_path):
    path = write_config(tmp_path / "ckpt", spelling)
    model = compose_model("model=hf", f"model.path={path}").model
    published = compose_model("model=qwen3_30b").model
    keys = [k for k in published if k not in ("_target_", "name")]
    assert {k: model[k] for k in keys} == {k: published[k] for k in keys}


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.rope_theta=10000"], "model.rope_theta"),  # the weights' shapes agree: only the check catches it
        (["model.norm_topk_prob=false"], "model.norm_topk_prob"),
        (["model.rms_norm_eps=1e-5"], "model.rms_norm_eps"),
        (["model.head_dim=64"], "model.head_dim"),
        (["model.num_layers=49"], "model.num_layers"),
        ([], "model.path"),  # required
        (["model.path=/nonexistent"], "model.path"),
    ],
)
def test_model_hf_refuses_contradicting_overrides(overrides, key, tmp_path, monkeypatch):
    from moe_lab import config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = write_config(tmp_path / "ckpt", TRANSFORMERS_5)
    given = [] if key == "model.path" and not overrides else [f"model.path={path}"]
    cfg = compose_model("model=hf", *given, *overrides)
    with pytest.raises(config.ConfigError) as e:
        config.validate(cfg)
    assert e.value.key == key, e.value


def test_init_checkpoint_config_json_is_checked_against_the_model(tmp_path, monkeypatch):
    """A checkpoint whose config.json contradicts the configured model is refused before anything loads."""
    from moe_lab import config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    hf = random_hf_model(True)
    hf.save_pretrained(tmp_path)
    shape = our_config(hf.config).to_dict()
    agreeing = [f"model.{k}={v}" for k, v in shape.items() if k not in ("name", "routing", "routing_skew")]
    config.validate(compose_model(*agreeing, f"trainer.init_checkpoint={tmp_path}", "data.seq_len=32"))
    cfg = compose_model(
        *agreeing, "model.rope_theta=1000000.0", f"trainer.init_checkpoint={tmp_path}", "data.seq_len=32"
    )
    with pytest.raises(config.ConfigError, match="trainer.init_checkpoint") as e:
        config.validate(cfg)
    assert e.value.key == "model.rope_theta"


@pytest.mark.parametrize("norm_topk_prob", ["true", "false"])
def test_an_exported_config_reads_back_as_the_model(norm_topk_prob, tmp_path):
    """``moe_lab.export``'s config.json, read by model=hf's reader and by transformers, is the model exported: every
    model key (the aux loss coefficient, init std and top-k renormalisation included) comes back."""
    from omegaconf import OmegaConf

    from moe_lab.export import hf_config
    from moe_lab.models.hf_config import read_hf_config

    overrides = ("model.router_aux_loss_coef=0.01", "model.init_std=0.01", f"model.norm_topk_prob={norm_topk_prob}")
    model = OmegaConf.to_container(compose_model(*overrides).model)
    path = write_config(tmp_path / "export", hf_config(model, torch.bfloat16))
    read = read_hf_config(path, "model.path")
    assert {k: read[k] for k in read if k != "name"} == {k: model[k] for k in read if k != "name"}
    assert transformers.AutoConfig.from_pretrained(path).router_aux_loss_coef == 0.01
    assert transformers.AutoConfig.from_pretrained(path).norm_topk_prob is (norm_topk_prob == "true")


def test_a_config_json_without_head_dim_reads_transformers_default(tmp_path):
    """Without ``head_dim``, transformers takes hidden_size / num_attention_heads (not the KV heads'): so does
    model=hf (64 / 4 = 16 here, where the 2 KV heads would give 32)."""
    from moe_lab.models.hf_config import read_hf_config

    values = {k: v for k, v in TRANSFORMERS_5.items() if k != "head_dim"}
    values |= {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1}
    path = write_config(tmp_path / "ckpt", values)
    with torch.device("meta"):  # transformers' own attention, as it builds it from the file
        attention = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    q_proj = attention.model.layers[0].self_attn.q_proj
    assert read_hf_config(path, "model.path")["head_dim"] == q_proj.out_features // 4 == 16


@pytest.mark.parametrize(
    "change, refused",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),  # the experts' gate: another function, the same shapes
        ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
        ({"rope_parameters": {"type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "'yarn'"),  # the older spelling
        ({"rope_parameters": "yarn"}, "rope_parameters='yarn'"),
        ({"rope_parameters": []}, r"rope_parameters=\[\]"),
        ({"rope_theta": 1e6, "rope_parameters": {"rope_theta": 1e4}}, "rope_parameters.rope_theta=10000.0"),
        ({"num_experts": 8}, "num_experts=8, num_local_experts=128"),
    ],
)
def test_a_config_json_read_otherwise_by_transformers_is_refused(change, refused, tmp_path):
    """What moe_lab would build otherwise than transformers does from one config.json is refused naming the file's
    key: another activation or attention dropout (not built), another RoPE in either spelling, or a key given in both
    spellings with two values (the two readers pick different ones). The same value twice, or swish for silu, reads."""
    from moe_lab.config import ConfigError
    from moe_lab.models.hf_config import read_hf_config

    path = write_config(tmp_path / "ckpt", {**TRANSFORMERS_5, **change})
    with pytest.raises(ConfigError, match=refused) as e:
        read_hf_config(path, "model.path")
    assert e.value.key == "model.path"
    agreeing = {**TRANSFORMERS_5, "hidden_act": "swish", "rope_theta": 1000000, "num_experts": 128}
    assert read_hf_config(write_config(tmp_path / "same", agreeing), "model.path")["rope_theta"] == 1e6


@pytest.mark.parametrize("setting", ["model.path", "trainer.init_checkpoint"])
def test_a_config_json_not_an_object_is_refused_naming_the_setting(setting, tmp_path):
    from moe_lab import config

    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text("[1, 2]")
    (path / "model.safetensors").write_bytes(b"")  # there: the config is read before any weight
    given = ["model=hf", f"model.path={path}"] if setting == "model.path" else [f"trainer.init_checkpoint={path}"]
    with pytest.raises(config.ConfigError, match="JSON list") as e:
        config.validate(compose_model(*given))
    assert e.value.key == setting
