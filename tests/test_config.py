"""Config composition and validation (issue 2, acceptance 1): every combination of group options composes and
validates; each bad override fails with one message naming its key."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import yaml
from hydra.errors import HydraException
from hydra.utils import get_object
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_lab import config
from moe_lab.config import ConfigError
from moe_lab.runtime.paths import CONF_DIR
from tests import configs

CONF = CONF_DIR
# Groups are those of train.yaml's defaults list; their options are whatever yamls their folders hold.
GROUPS = [
    group
    for entry in yaml.safe_load((CONF / "train.yaml").read_text())["defaults"]
    if isinstance(entry, dict)
    for group in entry
]
OPTIONS = {group: sorted(p.stem for p in (CONF / group).glob("*.yaml")) for group in GROUPS}
# Options with a required path (model=hf, data=tokens) describe the tiny model's shape and synthetic-like tokens
# here: they join the product once together, and each alone in SINGLE_OPTIONS.
NEEDS_PATH = {"model": "hf", "data": "tokens"}
# The loss reads no other group and no rule reads it: its options are each composed once, in SINGLE_OPTIONS, not in
# the product (which they would double).
# precision's options need 128-wide expert tiles and (fp8) a GPU: tests/test_precision.py validates each.
PRODUCT = [group for group in GROUPS if group not in ("loss", "precision")]
COMBINATIONS = [
    dict(zip(PRODUCT, choice))
    for choice in itertools.product(*([o for o in OPTIONS[g] if o != NEEDS_PATH.get(g)] for g in PRODUCT))
] + [{group: NEEDS_PATH.get(group, OPTIONS[group][0]) for group in PRODUCT}]
# Each option once at world 2 with EP=2 (the other groups at their defaults): every option's validate hook sees a mesh.
SINGLE_OPTIONS = [{group: option} for group in GROUPS if group != "precision" for option in OPTIONS[group]]


@pytest.fixture(scope="module", autouse=True)
def required_paths(tmp_path_factory):
    """What the options with a required key point at: a Hugging Face config.json of the tiny model's shape
    (model=hf) and a small prepared token directory (data=tokens)."""
    import json

    import numpy as np

    from moe_lab.data.prepare import write_token_dir

    base = tmp_path_factory.mktemp("required")
    tiny = yaml.safe_load((CONF / "model" / "tiny.yaml").read_text())
    hf = {
        "model_type": "qwen3_moe",
        "vocab_size": tiny["vocab_size"],
        "hidden_size": tiny["hidden_size"],
        "num_hidden_layers": tiny["num_layers"],
        "num_attention_heads": tiny["num_heads"],
        "num_key_value_heads": tiny["num_kv_heads"],
        "head_dim": tiny["head_dim"],
        "num_experts": tiny["num_experts"],
        "num_experts_per_tok": tiny["num_experts_per_tok"],
        "moe_intermediate_size": tiny["moe_intermediate_size"],
        "norm_topk_prob": True,
        "max_position_embeddings": tiny["max_position_embeddings"],
        "rope_theta": tiny["rope_theta"],
        "rms_norm_eps": tiny["rms_norm_eps"],
    }
    (base / "hf").mkdir()
    (base / "hf" / "config.json").write_text(json.dumps(hf))
    documents = (("eval" if d % 10 == 0 else "train", np.arange(50, dtype=np.uint32) + d) for d in range(100))
    write_token_dir(base / "tokens", documents, {"tokenizer": "test", "vocab_size": 256, "eos_id": 0})
    REQUIRED.update({"model=hf": f"model.path={base / 'hf'}", "data=tokens": f"data.path={base / 'tokens'}"})


REQUIRED: dict[str, str] = {}  # option -> the override its required key needs (filled by required_paths)


@pytest.fixture(autouse=True)
def no_outer_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # validation reads the world size from an outer launcher


def compose_train(overrides):
    """The composed config, with the required keys of the options chosen set (``REQUIRED``)."""
    overrides = list(overrides)
    return configs.compose_train(*overrides, *(REQUIRED[o] for o in overrides if o in REQUIRED))


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
    """At world 2, EP 2, validation hands back the option its yaml names, built with the yaml's values."""
    ((group, option),) = choice.items()
    cfg = compose_train([f"{group}={option}", "trainer.nproc_per_node=2", "parallel.ep=2"])
    built = getattr(config.validate(cfg), OPTION_FIELD.get(group, group))
    values = OmegaConf.to_container(cfg[group], resolve=True)
    cls = get_object(values.pop("_target_"))
    if values.pop("_partial_", False):  # the optimizer: a factory over the parameters
        built = built([torch.nn.Parameter(torch.zeros(1))])
        assert isinstance(built, cls) and {k: built.defaults[k] for k in values} == {
            k: _as(built.defaults[k], v) for k, v in values.items()
        }
        return
    assert type(built) is cls
    kept = {k: v for k, v in values.items() if hasattr(built, k)}  # the keys the option keeps as attributes
    assert {k: getattr(built, k) for k in kept} == {k: _as(getattr(built, k), v) for k, v in kept.items()}
    assert kept or not values, f"{group}={option} keeps none of its keys {sorted(values)}"


OPTION_FIELD = {"optimizer": "make_optimizer"}  # the Options field of a group named otherwise


def _as(built, value):
    """A yaml value as the option keeps it (a list as a tuple, a path as a Path)."""
    return type(built)(value) if isinstance(built, (tuple, Path)) else value


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
    (["ac=selective", "ac.keep=router"], {}, "ac.keep"),  # a list key given a string: not read letter by letter
    (["optimizer.betas=0.9"], {}, "optimizer.betas"),  # nor a number left to the class to fail on
    (["ac=full", "ac._target_=moe_lab.metrics.logger.NoLogger"], {}, "ac._target_"),  # a class without the contract
    (["offload._target_=moe_lab.parallel.ac.NoCheckpoint"], {}, "offload._target_"),
    (["ac=full", "ac._target_=moe_lab.parallel.ac.Checkpointing"], {}, "ac._target_"),  # the contract itself
    (["ac=full", "ac._target_=collections.OrderedDict"], {}, "ac._target_"),  # a builtin: no keys to read
    (["trainer.nproc_per_node=3", "parallel.ep=3"], {}, "parallel.ep"),  # 8 experts over 3 ranks
    (["parallel.ep=2"], {}, "parallel.ep"),  # more EP ranks than the job has
    (["optimizer.lr=-1e-3"], {}, "optimizer.lr"),
    (["optimizer=signsgd", "optimizer.lr=0"], {}, "optimizer.lr"),
    (["optimizer.lr=abc"], {}, "optimizer.lr"),
    (["optimizer.betas=[0.9]"], {}, "optimizer.betas"),
    (["model.num_experts_per_tok=9"], {}, "model.num_experts_per_tok"),
    (["data.seq_len=4096"], {}, "data.seq_len"),
    (["model=qwen3_30b", "data.seq_len=65536"], {}, "data.seq_len"),
    (["parallel.dp_shard=2"], {}, "parallel.dp_shard"),  # no such key: FSDP2 shards the dense weights over all ranks
    (["parallel.ep=8"], {"WORLD_SIZE": "4"}, "parallel.ep"),  # under an outer torchrun: its world, not nproc_per_node
    # the fused gpu backend's EP group spans two nodes of 2 ranks (symmetric memory reaches peers in a node only)
    (["dispatcher=fused", "parallel.ep=4"], {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, "parallel.ep"),
    # FP8 experts quantize in 128-wide tiles: not the tiny model's 64 (any save mode: the op keeps what it is told)
    (["dispatcher=fused", "dispatcher.expert_precision=fp8", "dispatcher.save=inputs"], {}, "model.hidden_size"),
    (["trainer.steps=abc"], {}, "trainer.steps"),
    (["trainer.dry_run=maybe"], {}, "trainer.dry_run"),
    (["trainer.resume_fallback=maybe"], {}, "trainer.resume_fallback"),
    (["model.num_experts=abc"], {}, "model.num_experts"),
    (["model.routing=foo"], {}, "model.routing"),
    (["model.routing_skew=0"], {}, "model.routing_skew"),
    (["data.restart_prob=1.5"], {}, "data.restart_prob"),
    (["trainer.device=tpu"], {}, "trainer.device"),
    *([(["trainer.device=cuda"], {}, "trainer.device")] if not torch.cuda.is_available() else []),
    (["trainer.precision=fp8"], {}, "trainer.precision"),
    (["ac=selective", "ac.keep=[attention,everything]"], {}, "ac.keep"),
    (["ac=selective", "ac.offload_activations=true"], {}, "ac.offload_activations"),  # eager selective
    (["dispatcher=fused", "dispatcher.save=nothing"], {}, "dispatcher.save"),
    (["model.num_kv_heads=3"], {}, "model.num_kv_heads"),
    (["model.moe_intermediate_size=0"], {}, "model.moe_intermediate_size"),
    (["data.batch_size=0"], {}, "data.batch_size"),
    (["model.hidden_size=60"], {}, "model.hidden_size"),  # the torch dispatcher's grouped GEMM alignment
    (["trainer.grad_clip=-1"], {}, "trainer.grad_clip"),
    (["data.vocab_size=0"], {}, "data.vocab_size"),
    (["optimizer.weight_decay=-1"], {}, "optimizer.weight_decay"),
    (["optimizer.betas=[0.9,2.0]"], {}, "optimizer.betas"),
    (["optimizer.eps=-1"], {}, "optimizer.eps"),
    (["optimizer.lr=inf"], {}, "optimizer.lr"),
    (["+optimizer.foreach=true"], {}, "optimizer.foreach"),  # was torch's "fused and foreach ... can't both be True"
    (["trainer.init_checkpoint=/nonexistent/checkpoint"], {}, "trainer.init_checkpoint"),
    (["trainer.init_checkpoint=''"], {}, "trainer.init_checkpoint"),
    (["model.router_balance=foo"], {}, "model.router_balance"),
    (["model.router_aux_loss_coef=-1"], {}, "model.router_aux_loss_coef"),
    (["model.router_bias_update_rate=-0.1"], {}, "model.router_bias_update_rate"),
    (["trainer.eval_every=-1"], {}, "trainer.eval_every"),
    (["trainer.eval_batches=0"], {}, "trainer.eval_batches"),
    (["trainer.expert_load_every=-1"], {}, "trainer.expert_load_every"),
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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ac=selective", "ac.keep=router"], "got 'router'"),  # was read a letter at a time: "unknown set 'r'"
        (["optimizer.betas=0.9"], "got 0.9"),  # was left to the class: "'float' object is not iterable", no key
    ],
)
def test_a_list_key_given_a_scalar_is_the_wrong_type(overrides, message):
    kind, text = failure(overrides)
    assert "expected a list of" in text and message in text, text


def test_fused_ep_group_across_nodes_runs_on_the_reference_backend_only(monkeypatch):
    """The node rule is the gpu backend's: the reference backend exchanges over the process group, any group."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    within = compose_train(["dispatcher=fused", "parallel.ep=2"])
    assert config.validate(within).dispatcher.backend == "auto"
    across = compose_train(["dispatcher=fused", "dispatcher.backend=reference", "parallel.ep=4"])
    assert config.validate(across).dispatcher.backend == "reference"


def test_validation_returns_the_options_it_built():
    """Validation builds each option once and hands it over: the trainer builds nothing from the config again."""
    options = config.validate(compose_train(["dispatcher=fused", "offload=optimizer"]))
    assert (
        type(options.dispatcher).__name__ == "FusedDispatcher" and type(options.offload).__name__ == "OptimizerOffload"
    )
    assert options.model.num_layers == 2 and options.data.seq_len == 128


@pytest.mark.parametrize(
    "edge", [["model.num_experts_per_tok=8"], ["data.seq_len=2048"], ["optimizer.betas=[0.0,0.0]"]]
)
def test_a_value_at_its_bounds_edge_validates(edge):
    """The bounds' inclusive ends are allowed: every expert chosen for each token, a sample as long as the model's
    context (the tiny model's 2048), betas of 0."""
    config.validate(compose_train(edge))


def test_huge_vocabulary_fails_without_allocating_it():
    """Building the data option allocates nothing per vocabulary entry before its size is checked."""
    kind, message = failure(["model.vocab_size=20000000000", "data.vocab_size=20000000001"])
    assert kind == "validate:data.vocab_size", message


def test_unknown_option_lists_the_allowed_ones():
    _, message = failure(["model=foo"])
    assert all(option in message for option in OPTIONS["model"]), message


def test_unknown_key_lists_the_allowed_ones():
    _, message = failure(["+model.foo=1"])
    assert "num_experts" in message and "routing" in message, message


# Published config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (Hugging Face), in this project's names.
PUBLISHED = {
    "qwen3_30b": dict(
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
    "qwen3_235b": dict(
        vocab_size=151936,
        hidden_size=4096,
        num_layers=94,
        num_heads=64,
        num_kv_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    ),
}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_model_options_match_published_config(model):
    cfg = compose_train([f"model={model}"])
    assert {k: cfg.model[k] for k in PUBLISHED[model]} == PUBLISHED[model]
