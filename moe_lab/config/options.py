"""The options of one composed config, built once: validation builds them (their constructors check their own
values) and hands them to the trainer, which builds nothing from the config again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from moe_lab.runtime.errors import ConfigError


@dataclass
class Options:
    model: Any  # the model's config (moe_lab.models.qwen3_moe.Qwen3MoeConfig); ``.build()`` makes the module
    dispatcher: Any
    ac: Any
    offload: Any
    make_optimizer: Callable  # params -> torch.optim.Optimizer (a partial of the optimizer class)
    data: Any
    logger: Any  # used on rank 0 only

    def with_rules(self) -> list:
        """The options that own cross-group rules (a ``validate(cfg)`` method)."""
        return [o for o in (self.dispatcher, self.ac, self.offload, self.data, self.logger) if hasattr(o, "validate")]


def build_options(cfg: DictConfig) -> Options:
    return Options(**{field: _build(cfg, group) for field, group in _GROUP_OF.items()})


_GROUP_OF = {"model": "model", "dispatcher": "dispatcher", "ac": "ac", "offload": "offload",
             "make_optimizer": "optimizer", "data": "data", "logger": "logger"}  # fmt: skip


def _build(cfg: DictConfig, group: str):
    try:
        return instantiate(cfg[group])
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None  # Hydra wraps what a constructor raises
        raise
