"""The hardware profile's host memory is the node's the plan runs on, never the memory of the machine planning: a
profile that leaves the node's size to the plan gives it per GPU (conf/hardware/*.yaml), an explicit
``hardware.host_memory_gib`` is the node's."""

from __future__ import annotations

from collections import namedtuple

import psutil
import pytest

from moe_lab.config import ConfigError
from moe_lab.plan.config import compose
from moe_lab.plan.planner import build_hardware, plan


@pytest.mark.parametrize("gpus, node_gib", [(1, 126.0), (2, 252.0), (8, 1008.0)])
def test_h200_node_host_memory_follows_its_gpus(gpus, node_gib):
    assert build_hardware(compose([f"hardware.gpus_per_node={gpus}"]).hardware).host_memory_gib == node_gib
    given = compose([f"hardware.gpus_per_node={gpus}", "hardware.host_memory_gib=503"]).hardware
    assert build_hardware(given).host_memory_gib == 503


def test_offload_depths_of_an_8_gpu_node_use_the_profiles_host_memory(monkeypatch):
    """``python -m moe_lab.plan hardware=h200 hardware.gpus_per_node=8``: the node holds 8 x 126 GiB, so moving the
    optimizer state to the host fits a deeper model than keeping it on the GPUs; a planning machine with 8 GiB of
    memory changes nothing."""
    VirtualMemory = namedtuple("VirtualMemory", "total available percent used free")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VirtualMemory(8 * 2**30, 8 * 2**30, 0.0, 0, 8 * 2**30))
    planned = plan(compose(["hardware=h200", "hardware.gpus_per_node=8", "model=qwen3_30b"]))["plan"]
    assert planned["hardware"]["host_memory_gib"] == 1008.0
    deepest = {mode: fit["num_layers"] for mode, fit in planned["largest_fitting"].items()}
    assert deepest["optimizer"] > deepest["none"] and deepest["full"] > deepest["none"], deepest


def test_a_fit_at_the_searchs_limit_is_printed_as_at_least():
    """The tiny model fits at any depth and its every position: the console says ">= limit", not that the limit is
    the largest that fits; a depth that stops at memory (qwen3_30b's on one H200) is printed as it is."""
    from moe_lab.plan.__main__ import at_least

    tiny = plan(compose([]))["plan"]
    assert tiny["largest_fitting_limits"] == {"num_layers": 256, "seq_len": 2048}
    for fit in tiny["largest_fitting"].values():
        assert at_least(fit, tiny, "num_layers") == ">= 256 (the search's limit)"
        assert at_least(fit, tiny, "seq_len") == ">= 2048 (the search's limit)"
    large = plan(compose(["model=qwen3_30b", "model.num_layers=4"]))["plan"]
    fit = large["largest_fitting"]["none"]
    assert fit["num_layers"] < 256 and at_least(fit, large, "num_layers") == str(fit["num_layers"])


def test_a_profile_without_host_memory_names_the_key():
    with pytest.raises(ConfigError) as error:
        build_hardware(compose(["hardware.host_memory_gib_per_gpu=null"]).hardware)
    assert error.value.key == "hardware.host_memory_gib"
