"""The planner's config: train's (``conf/train.yaml``: every group, preset and key ``moe_lab.train`` takes)
plus the ``hardware`` group (``conf/hardware/``), which train's schema does not have. Stored as the primary
config ``plan`` from train.yaml's own defaults list, so the two never drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore

from moe_lab import config
from moe_lab.config.schema import TrainConfig
from moe_lab.runtime.paths import CONF_DIR

DEFAULT_HARDWARE = "h200"


@dataclass
class PlanConfig(TrainConfig):
    hardware: Any = None


def train_defaults(schema: str, *groups: dict) -> tuple[dict, list]:
    """train.yaml and its defaults list with ``schema`` in place of train's and ``groups`` (``{group: option}``)
    added before ``_self_``: what an entry point built on train's config stores as its primary config."""
    train = yaml.safe_load((CONF_DIR / "train.yaml").read_text())
    defaults = [schema if d == "train_schema" else d for d in train["defaults"]]
    at = defaults.index("_self_")
    defaults[at:at] = groups
    return train, defaults


def register() -> None:
    config.register()
    store = ConfigStore.instance()
    store.store(name="plan_schema", node=PlanConfig)
    train, defaults = train_defaults("plan_schema", {"hardware": DEFAULT_HARDWARE})
    hydra = train["hydra"]
    hydra["run"]["dir"] = "outputs/plan/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    hydra["sweep"]["dir"] = "multirun/plan/${now:%Y-%m-%d}/${now:%H-%M-%S}"
    store.store(name="plan", node={**train, "defaults": defaults, "hydra": hydra})


def compose(overrides: list[str]):
    """The plan config with ``overrides``, outside a Hydra app (tests, record comparisons)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("plan", overrides=overrides)
