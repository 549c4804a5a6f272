"""The options of one composed config, built once: validation builds them (their constructors check their own
values) and hands them to the trainer, which builds nothing from the config again."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig

from moe_lab.data.batch import DataSource
from moe_lab.metrics.logger import ExperimentLogger
from moe_lab.models.loss import LanguageModelLoss
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from moe_lab.moe.dispatcher import TokenDispatcher
from moe_lab.optim.offload import Offload
from moe_lab.optim.optimizers import OptimizerFactory
from moe_lab.parallel.ac import Checkpointing
from moe_lab.parallel.precision import Precision
from moe_lab.runtime.errors import ConfigError


@dataclass
class Options:
    """Each group's option, built; its type is the group's contract (written in the group's module)."""

    model: Qwen3MoeConfig  # ``.build()`` makes the module
    dispatcher: TokenDispatcher
    precision: Precision  # applied to the model before the parallelisms
    ac: Checkpointing
    offload: Offload
    make_optimizer: OptimizerFactory  # params -> torch.optim.Optimizer (a partial of the optimizer class)
    loss: LanguageModelLoss  # (hidden, head weight, labels) -> the loss; called in the model's forward
    data: DataSource
    logger: ExperimentLogger  # used on rank 0 only

    def with_rules(self) -> list:
        """The options that own cross-group rules (their ``validate(cfg, target)``), in the order validation runs them."""
        # precision before the dispatcher: where both refuse, the precision's refusal is the one a user acts on first
        return [self.precision, self.dispatcher, self.ac, self.offload, self.data, self.logger]


def build_options(cfg: DictConfig) -> Options:
    return Options(**{field: _build(cfg, group, CONTRACTS[field]) for field, group in _GROUP_OF.items()})


_GROUP_OF = {
    "model": "model",
    "dispatcher": "dispatcher",
    "precision": "precision",
    "ac": "ac",
    "offload": "offload",
    "make_optimizer": "optimizer",
    "loss": "loss",
    "data": "data",
    "logger": "logger",
}
CONTRACTS = {
    "model": Qwen3MoeConfig,
    "dispatcher": TokenDispatcher,
    "precision": Precision,
    "ac": Checkpointing,
    "offload": Offload,
    "make_optimizer": OptimizerFactory,
    "loss": LanguageModelLoss,
    "data": DataSource,
    "logger": ExperimentLogger,
}


def _build(cfg: DictConfig, group: str, contract: type):
    target, contract_name = get_object(cfg[group]._target_), f"{contract.__module__}.{contract.__name__}"
    if inspect.isclass(target) and (inspect.isabstract(target) or getattr(target, "_is_protocol", False)):
        message = (
            f"{cfg[group]._target_} is abstract (a contract, not an option): name a class that provides {contract_name}"
        )
        raise ConfigError(f"{group}._target_", message)
    try:
        option = instantiate(cfg[group])
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None  # Hydra wraps what a constructor raises
        raise
    if not isinstance(option, contract):
        message = f"{cfg[group]._target_} is no {group} option: it does not provide {contract_name}"
        raise ConfigError(f"{group}._target_", message)
    return option
