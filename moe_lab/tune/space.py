"""The search space: the ``tune`` group's option (``conf/tune/``, class ``Space``), narrowed by the command line, and
the points it spans.

An axis is a config group (``dispatcher``: its options) or a dotted key (``ac.keep``: its values). The group axes
span combinations of options, each composed once; the key axes then span values within each combination, an axis
applying only where the combination's config has its key (``dispatcher.save`` under ``dispatcher=fused``).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from dataclasses import dataclass, field

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from moe_lab.config import ConfigError
from moe_lab.config.validate import check_target_node, options_of
from moe_lab.runtime.paths import CONF_DIR

DEVICES = ("auto", "cuda", "cpu")
NOT_AXES = ("hardware", "tune", "hydra", "experiment")  # groups that say what is tuned, where, or how


class Space:
    """The axes a tune searches (group or dotted key -> its values, planned in every combination), how many of the
    best planned points it measures (``measure``; 0: plan only), where (``device``: auto | cuda | cpu), into which
    directory (``dir``), with how many planning processes (``workers``; null: the cores, at most 4)."""

    def __init__(self, axes: dict, measure: int = 3, device: str = "auto", dir: str = "", workers: int | None = None):
        if measure < 0:
            raise ConfigError("tune.measure", f"must be >= 0 (0: plan only), got {measure}")
        if device not in DEVICES:
            raise ConfigError("tune.device", f"must be one of {', '.join(DEVICES)}, got {device!r}")
        if not dir:
            raise ConfigError("tune.dir", "must name the tune's directory")
        if workers is not None and workers < 1:
            raise ConfigError("tune.workers", f"must be >= 1 or null, got {workers}")
        for name, values in axes.items():
            if not isinstance(values, (list, tuple)):  # a bare value would be searched as its characters
                raise ConfigError(f"tune.axes.{name}", f"must be a list of values, e.g. [{values}], got {values!r}")
        self.axes = {name: list(values) for name, values in axes.items()}
        for name, values in self.axes.items():
            check_axis(f"tune.axes.{name}", name, values)
        self.measure, self.device, self.dir, self.workers = measure, device, dir, workers


TUNE_KEYS = tuple(inspect.signature(Space).parameters)


def check_tune_overrides(overrides: list[str], option_axes: list[str]) -> None:
    """The command line's ``tune.<key>`` overrides, before Hydra composes them: a key must be one of ``Space``'s,
    and ``tune.axes.<name>`` without ``+`` one of the option's axes (Hydra would advise appending a misspelt key
    with ``+``); a dotted axis is one key of ``tune.axes``, which Hydra cannot reach as a path."""
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if not key.startswith("tune."):
            continue
        tune_key, _, name = key.removeprefix("tune.").partition(".")
        if tune_key not in TUNE_KEYS:
            raise ConfigError(key, f"unknown key of the tune; allowed: {', '.join(TUNE_KEYS)}")
        if override.is_sweep_override():  # the tune is one run: a sweep of its keys would be dropped
            raise ConfigError(key, "takes one value (an axis's values are a list: tune.axes.<name>=[a,b])")
        if tune_key != "axes" or not name:
            continue
        adding = override.is_add() or override.is_force_add()
        if name not in option_axes and not adding:
            raise ConfigError(
                key, f"no such axis (axes: {', '.join(option_axes)}); a new axis is added with {axis_override(name)}"
            )
        if "." in name:
            raise ConfigError(
                key, f"a dotted axis is one key of tune.axes, not a path under it: set it with {axis_override(name)}"
            )


def axis_override(name: str) -> str:
    """The override that adds an axis or sets its values: a dotted key as one key of the ``tune.axes`` dict."""
    return f"'+tune.axes={{{name}:[...]}}'" if "." in name else f"+tune.axes.{name}=[...]"


def is_group(name: str) -> bool:
    return "." not in name and name not in NOT_AXES and (CONF_DIR / name).is_dir()


def check_axis(key: str, name: str, values: list) -> None:
    """An axis must be a group of conf/ (each value one of its options) or a dotted key, with at least one value."""
    if not values:
        raise ConfigError(key, "an axis needs at least one value")
    if "." not in name:
        if not is_group(name):
            groups = [p.name for p in sorted(CONF_DIR.iterdir()) if p.is_dir() and is_group(p.name)]
            raise ConfigError(key, f"{name!r} is neither a config group ({', '.join(groups)}) nor a dotted key")
        unknown = [v for v in values if str(v) not in options_of(name)]
        if unknown:
            raise ConfigError(key, f"no option {unknown[0]!r} of {name}; options: {', '.join(options_of(name))}")


@dataclass
class Narrowed:
    """The space as the command line leaves it: ``axes`` still searched, ``base`` the overrides every point shares
    (the command line's own, but the tune's keys and the sweeps that narrowed an axis)."""

    axes: dict[str, list]
    base: list[str]
    fixed: dict[str, str] = field(default_factory=dict)  # axis -> the value the command line gave it


def narrowed(space: Space, overrides: list[str]) -> Narrowed:
    """``ac=full,selective`` narrows an axis to those values; ``dispatcher=fused`` fixes a group axis (the axis is
    left out, the override stays in ``base``), ``dispatcher.save=inputs`` a key axis to that one value (set where a
    point has the key); a sweep of anything that is not an axis is refused, naming its key."""
    axes = dict(space.axes)
    base, fixed = [], {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element().lstrip("+~")
        if key == "tune" or key.startswith("tune."):
            continue
        if override.is_sweep_override():
            if key not in axes:
                raise ConfigError(key, f"a sweep (a,b) is only for an axis of the tune; axes: {', '.join(axes)}")
            values = list(override.sweep_iterator())
            check_axis(key, key, values)
            axes[key] = values
            continue
        if key in axes and not is_group(key):  # one value, still set only where a point has the key
            axes[key] = [override.value()]
            fixed[key] = override.get_value_element_as_str()
            continue
        if key in axes:
            del axes[key]
            fixed[key] = override.get_value_element_as_str()
        base.append(override.input_line)
    return Narrowed(axes=axes, base=base, fixed=fixed)


def override_value(value) -> str:
    """A value as Hydra's override grammar reads it back."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    return str(value)


def group_combinations(axes: dict[str, list]) -> list[list[str]]:
    """Every combination of the group axes' options, as overrides (``[dispatcher=fused, ac=full, ...]``)."""
    groups = [(name, values) for name, values in axes.items() if is_group(name)]
    return [
        [f"{name}={value}" for (name, _), value in zip(groups, chosen)]
        for chosen in itertools.product(*(values for _, values in groups))
    ]


def has_key(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and leaf in node


def key_points(cfg: DictConfig, axes: dict[str, list]) -> list[list[tuple[str, object]]]:
    """Every combination of the key axes that apply to ``cfg`` (its config has the key), as (key, value) pairs."""
    keys = [(name, values) for name, values in axes.items() if not is_group(name) and has_key(cfg, name)]
    return [list(zip((k for k, _ in keys), chosen)) for chosen in itertools.product(*(v for _, v in keys))]


def option_keys(group: str) -> set[str]:
    """The keys the options of ``group`` set (their yaml files' top level)."""
    return {k for p in (CONF_DIR / group).glob("*.yaml") for k in (OmegaConf.load(p) or {})}


def check_keys_exist(axes: dict[str, list], configs: list[DictConfig]) -> None:
    """A key axis must be a key of some point's config, or of some option of its group (an axis the narrowed groups
    leave no point of, ``ac.keep`` with ``ac=none,full``, applies nowhere): else it is misspelt or absent, refused
    before planning."""
    for name in axes:
        if is_group(name) or any(has_key(cfg, name) for cfg in configs):
            continue
        section, _, leaf = name.partition(".")
        if is_group(section) and leaf in option_keys(section):
            continue
        parent = name.rpartition(".")[0]
        known = sorted({k for cfg in configs for k in (OmegaConf.select(cfg, parent) or {})} - {"_target_"})
        if is_group(section):
            known = sorted(set(known) | option_keys(section) - {"_target_"})
        raise ConfigError(
            f"tune.axes.{name}",
            "no point of the space has this key" + (f"; {parent} has: {', '.join(known)}" if known else ""),
        )


def check_key_values(axes: dict[str, list], configs: list[DictConfig]) -> None:
    """The values of a key axis of a group's option (``dispatcher.save``, ``ac.keep``) must be of the option's
    signature: each set on a copy of the option's node in every config that has the key, checked as validation
    checks the node (a misspelt value is refused naming its key, as ``moe_lab.plan`` refuses it, rather than
    planned as invalid at every point it reaches)."""
    for name, values in axes.items():
        group, _, leaf = name.partition(".")
        if not leaf or not is_group(group):
            continue
        for cfg in configs:
            if not has_key(cfg, name):
                continue
            for value in values:
                node = copy.deepcopy(cfg[group])  # keeps its parent: its interpolations still resolve
                OmegaConf.update(node, leaf, value, merge=False)
                check_target_node(group, node)
