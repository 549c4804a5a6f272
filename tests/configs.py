"""The training config as ``python -m moe_lab.train`` composes it (conf/, the schema registered), for tests and for
the rank workers they start, and the overrides that shrink any preset to a quick CPU run of the tiny model.
Test functions take them as the fixtures ``compose_train`` and ``tiny_overrides`` (tests/conftest.py)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from moe_lab import config
from moe_lab.runtime.paths import CONF_DIR

# The tiny model on the CPU in fp32, uncompiled, two short steps, a one-step profile window.
TINY = [
    "model=tiny",
    "trainer.device=cpu",
    "trainer.compile=false",
    "trainer.precision=fp32",
    "data.seq_len=32",
    "data.batch_size=2",
    "trainer.steps=2",
    "trainer.warmup_steps=1",
    "trainer.timing_skip=0",
    "profile.wait=1",
    "profile.warmup=0",
    "profile.active=1",
]


def compose_train(*overrides: str, return_hydra_config: bool = False) -> DictConfig:
    """``conf/train.yaml`` with ``overrides``, as the command line composes it."""
    config.register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=return_hydra_config)
