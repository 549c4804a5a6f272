"""Every option the planner plans has its planner model (moe_lab.plan.models): each yaml of conf/<group>/ for the
groups a plan depends on names a class the planner models, so adding an option without teaching the planner fails
here; an option class it does not know is refused naming the key."""

from __future__ import annotations

import pytest
import yaml
from hydra.utils import get_object

from moe_lab.config import ConfigError
from moe_lab.moe.dispatcher import TokenDispatcher
from moe_lab.plan.models import MODELS, PLANNED_GROUPS, model_of, option_class
from moe_lab.runtime.paths import CONF_DIR


def planned_options():
    for group in PLANNED_GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            yield pytest.param(group, path, id=f"{group}={path.stem}")


@pytest.mark.parametrize("group, path", list(planned_options()))
def test_every_option_yaml_has_a_planner_model(group, path):
    target = get_object(yaml.safe_load(path.read_text())["_target_"])
    assert any(klass in MODELS[group] for klass in target.__mro__), f"{path}: no planner model of {target}"


@pytest.mark.parametrize("group", PLANNED_GROUPS)
def test_each_group_models_its_yamls_only_once(group):
    names = [m.name for m in MODELS[group].values()]
    assert len(names) == len(set(names)), names
    for option_cls, model in MODELS[group].items():
        assert model.option_class is option_cls


def test_an_unmodelled_option_is_refused_naming_its_key():
    class Unplanned(TokenDispatcher):
        saved_ops = frozenset()

        def __call__(self, x, topk_ids, topk_weights, gate_up_proj, down_proj):
            return x

    with pytest.raises(ConfigError) as error:
        model_of("dispatcher", Unplanned())
    assert error.value.key == "dispatcher._target_"
    assert "Unplanned" in str(error.value) and "TorchDispatcher" in str(error.value)


def test_an_optimizer_option_is_modelled_by_its_class():
    import functools

    import torch

    assert option_class(functools.partial(torch.optim.AdamW, lr=1e-3)) is torch.optim.AdamW
    assert model_of("optimizer", functools.partial(torch.optim.AdamW, lr=1e-3)).name == "adamw"


def test_each_model_holds_the_option_validate_built():
    """A plan's step holds, per group, the planner model of the very option ``moe_lab.config.validate`` built."""
    from moe_lab.plan.config import compose
    from moe_lab.plan.planner import OPTION_FIELD, build_hardware, step_of, validated

    cfg = compose(["model=qwen3_30b", "model.num_layers=2", "dispatcher=fused", "loss=chunked", "offload=optimizer"])
    hw = build_hardware(cfg.hardware)
    train, options = validated(cfg, hw)
    step = step_of(train, options, hw)
    for group in PLANNED_GROUPS:
        assert getattr(step, group).option is getattr(options, OPTION_FIELD[group]), group
