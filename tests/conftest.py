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


@pytest.fixture
def compose_train():
    """``compose_train(*overrides, return_hydra_config=False)``: the training config as moe_lab.train composes it."""
    return configs.compose_train


@pytest.fixture
def tiny_overrides() -> list[str]:
    """Overrides that make any preset a two-step CPU run of the tiny model."""
    return list(configs.TINY)
