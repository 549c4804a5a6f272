"""The tune's config: the planner's (``moe_lab.plan.config``: train's groups, presets and keys, and ``hardware``)
plus the ``tune`` group (``conf/tune/``), stored as the primary config ``tune`` from train.yaml's own defaults list."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

from moe_lab.plan import config as plan_config
from moe_lab.plan.config import PlanConfig
from moe_lab.runtime.paths import CONF_DIR

DEFAULT_TUNE = "default"


@dataclass
class TuneConfig(PlanConfig):
    tune: Any = None


def register() -> None:
    plan_config.register()
    store = ConfigStore.instance()
    store.store(name="tune_schema", node=TuneConfig)
    train, defaults = plan_config.train_defaults(
        "tune_schema", {"hardware": plan_config.DEFAULT_HARDWARE}, {"tune": DEFAULT_TUNE}
    )
    store.store(name="tune", node={"defaults": defaults, "hydra": {"searchpath": train["hydra"]["searchpath"]}})


def compose(overrides: list[str], config_name: str = "tune"):
    """The tune config with ``overrides`` (outside a Hydra app: the tune composes every point itself); with
    ``config_name="train"``, the training config a measured point runs."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=overrides)
