"""Config composition and validation (issue 2, acceptance 1): every combination of group options composes and
validates; each bad override fails with one message naming its key."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from moe_lab import config
from moe_lab.config import ConfigError

CONF = Path(__file__).resolve().parents[1] / "moe_lab" / "conf"
# Groups are those of train.yaml's defaults list; their options are whatever yamls their folders hold.
GROUPS = [
    group
    for entry in yaml.safe_load((CONF / "train.yaml").read_text())["defaults"]
    if isinstance(entry, dict)
    for group in entry
]
OPTIONS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml")) for group in GROUPS}
COMBINATIONS = [dict(zip(GROUPS, choice)) for choice in itertools.product(*(OPTIONS[g] for g in GROUPS))]
# Each option once at world 2 with EP=2 (the other groups at their defaults): every option's validate hook sees a mesh.
SINGLE_OPTIONS = [{group: option} for group in GROUPS for option in OPTIONS[group]]


@pytest.fixture(scope="module", autouse=True)
def hydra_conf():
    config.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


@pytest.fixture(autouse=True)
def no_outer_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # validation reads the world size from an outer launcher


def compose_train(overrides):
    return compose(config_name="train", overrides=list(overrides))


def test_every_group_has_options():
    assert all(OPTIONS[g] for g in GROUPS), OPTIONS


def test_groups_found():
    assert {"model", "dispatcher", "ac", "offload", "optimizer", "data"} <= set(GROUPS)


@pytest.mark.parametrize("choice", COMBINATIONS, ids=lambda c: ",".join(c.values()))
def test_every_combination_composes_and_validates(choice):
    cfg = compose_train([f"{g}={o}" for g, o in choice.items()])
    config.validate(cfg)
    assert all(cfg[g]._target_ for g in GROUPS)


@pytest.mark.parametrize("choice", SINGLE_OPTIONS, ids=lambda c: ",".join(f"{g}={o}" for g, o in c.items()))
def test_every_option_validates_at_world2_ep2(choice):
    cfg = compose_train([f"{g}={o}" for g, o in choice.items()] + ["trainer.nproc_per_node=2", "parallel.ep=2"])
    config.validate(cfg)


# (overrides, extra environment, key the message must name)
BAD = [
    (["model=foo"], {}, "model"),
    (["ac=foo"], {}, "ac"),
    (["trainer.foo=1"], {}, "trainer.foo"),
    (["+trainer.foo=1"], {}, "trainer.foo"),  # appending gets past Hydra's struct flag, not past validation
    (["+foo=1"], {}, "foo"),
    (["model.foo=1"], {}, "model.foo"),
    (["+model.foo=1"], {}, "model.foo"),
    (["dispatcher.foo=1"], {}, "dispatcher.foo"),
    (["+dispatcher.foo=1"], {}, "dispatcher.foo"),
    (["+optimizer.foo=1"], {}, "optimizer.foo"),
    (["trainer.nproc_per_node=3", "parallel.ep=3"], {}, "parallel.ep"),  # 8 experts over 3 ranks
    (["parallel.ep=2"], {}, "parallel.ep"),  # more EP ranks than the job has
    (["optimizer.lr=-1e-3"], {}, "optimizer.lr"),
    (["optimizer=signsgd", "optimizer.lr=0"], {}, "optimizer.lr"),
    (["optimizer.lr=abc"], {}, "optimizer.lr"),
    (["optimizer.betas=[0.9]"], {}, "optimizer.betas"),
    (["model.num_experts_per_tok=9"], {}, "model.num_experts_per_tok"),
    (["data.seq_len=4096"], {}, "data.seq_len"),
    (["model=qwen3_30b", "data.seq_len=65536"], {}, "data.seq_len"),
    (["trainer.nproc_per_node=2", "parallel.dp_shard=4"], {}, "parallel.dp_shard"),
    (["parallel.dp_shard=2"], {"WORLD_SIZE": "4"}, "parallel.dp_shard"),  # under an outer torchrun
    (["trainer.steps=abc"], {}, "trainer.steps"),
    (["trainer.dry_run=maybe"], {}, "trainer.dry_run"),
    (["model.num_experts=abc"], {}, "model.num_experts"),
    (["model.routing=foo"], {}, "model.routing"),
    (["model.routing_skew=0"], {}, "model.routing_skew"),
    (["data.restart_prob=1.5"], {}, "data.restart_prob"),
    (["trainer.device=tpu"], {}, "trainer.device"),
    *([(["trainer.device=cuda"], {}, "trainer.device")] if not torch.cuda.is_available() else []),
    (["trainer.precision=fp8"], {}, "trainer.precision"),
    (["model.num_kv_heads=3"], {}, "model.num_kv_heads"),
    (["model.moe_intermediate_size=0"], {}, "model.moe_intermediate_size"),
    (["data.batch_size=0"], {}, "data.batch_size"),
    (["model.hidden_size=60"], {}, "model.hidden_size"),  # the torch dispatcher's grouped GEMM alignment
    (["trainer.grad_clip=-1"], {}, "trainer.grad_clip"),
]


def failure(overrides) -> tuple[str, str]:
    """(kind, message) of the first failure: Hydra/OmegaConf at compose time, or ConfigError at validate time."""
    try:
        cfg = compose_train(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        cause = f"\n{e.__cause__}" if e.__cause__ is not None else ""
        return "compose", f"{e}{cause}"
    try:
        config.validate(cfg)
    except ConfigError as e:
        return f"validate:{e.key}", str(e)
    pytest.fail(f"{overrides} composed and validated")


@pytest.mark.parametrize("overrides,env,key", BAD, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_override_fails_naming_its_key(overrides, env, key, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kind, message = failure(overrides)
    if kind.startswith("validate:"):
        assert kind == f"validate:{key}", message  # ConfigError.key is the offending key
        assert message.startswith(f"{key}: ")
    assert key in message, message


def test_unknown_option_lists_the_allowed_ones():
    _, message = failure(["model=foo"])
    assert all(option in message for option in OPTIONS["model"]), message


def test_unknown_key_lists_the_allowed_ones():
    _, message = failure(["+model.foo=1"])
    assert "num_experts" in message and "routing" in message, message


# Published config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (Hugging Face), in this project's names.
PUBLISHED = {
    "qwen3_30b": dict(
        vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    "qwen3_235b": dict(
        vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, norm_topk_prob=True,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_model_options_match_published_config(model):
    cfg = compose_train([f"model={model}"])
    assert {k: cfg.model[k] for k in PUBLISHED[model]} == PUBLISHED[model]
