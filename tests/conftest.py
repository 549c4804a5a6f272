import os

import pytest
import torch

from tests import configs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_tmp_path(tmp_path_factory):
    """A directory all of this session's xdist workers share (each worker's base temp directory is below it; without
    xdist, the session's own): what one worker makes there once, the others find."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture
def compose_train():
    """``compose_train(*overrides, return_hydra_config=False)``: the training config as moe_lab.train composes it."""
    return configs.compose_train


@pytest.fixture
def tiny_overrides() -> list[str]:
    """Overrides that make any preset a two-step CPU run of the tiny model."""
    return list(configs.TINY)
