"""The planner's model of each option, one module per group: what a built option (the object
``moe_lab.config.validate`` builds) does to one rank's step memory and time. A model holds its option and reads its
values there; ``memory`` and ``step_time`` hold what every step shares (the ``Step``: model, sequence, batch, mesh)
and ask the step's models for the rest. A model is registered under its option's class (``planner_model``) and
built for an option by ``model_of``, so a new option is planned by registering its model in its group's module (a
test fails when a yaml of conf/<group>/ names a class without one).
"""

from __future__ import annotations

import inspect
from functools import partial

from moe_lab.runtime.errors import ConfigError

# group -> option class -> its model class, in registration order
MODELS: dict[str, dict[type, type]] = {
    "dispatcher": {},
    "precision": {},
    "ac": {},
    "offload": {},
    "optimizer": {},
    "loss": {},
}
PLANNED_GROUPS = tuple(MODELS)  # the groups whose options a plan depends on


class OptionModel:
    """A planner model: ``option``, the built option it plans (``name``: its yaml's)."""

    name: str
    option_class: type

    def __init__(self, option):
        self.option = option


def planner_model(group: str, option_class: type):
    """Class decorator: the planner's model of ``option_class`` (an option of ``group``)."""

    def register(model_class):
        model_class.option_class = option_class
        MODELS[group][option_class] = model_class
        return model_class

    return register


def option_class(option) -> type:
    """The class an option is of: an optimizer option is a partial of its class."""
    return option.func if isinstance(option, partial) else type(option)


def model_of(group: str, option) -> OptionModel:
    """The planner's model of a built option of ``group`` (its class's, or the nearest base class's)."""
    cls = option_class(option)
    for klass in cls.__mro__:
        if klass in MODELS[group]:
            return MODELS[group][klass](option)
    known = ", ".join(f"{c.__module__}.{c.__qualname__}" for c in MODELS[group])
    name = f"{cls.__module__}.{cls.__qualname__}"
    raise ConfigError(f"{group}._target_", f"the planner has no model of {name}; it models {known}")


def named(group: str, name: str) -> type:
    """The model class of ``group``'s option named ``name`` (its yaml's)."""
    return next(m for m in MODELS[group].values() if m.name == name)


def with_values(option, **values):
    """``option`` built again with ``values`` for some of its constructor's arguments (the others as it holds
    them): a setting the planner's searches try, as its overrides would build it."""
    cls = type(option)
    held = {name: getattr(option, name) for name in inspect.signature(cls).parameters}
    return cls(**(held | values))


# each group's module registers its models
from moe_lab.plan.models import ac, dispatcher, loss, offload, optimizer, precision  # noqa: E402, F401
