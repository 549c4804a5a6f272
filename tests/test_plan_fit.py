"""The planner's fit at memory's edge (``moe_lab.plan.planner.fits``): a plan fits when its allocated peak, as the
caching allocator reserves it at the edge, fits the GPU; it is at the edge when it would not fit at the largest
reserve the records show. Both reserves are the committed records' (``moe_lab.plan.records.allocator_reserve``).
No model is built and no GPU is used."""

from __future__ import annotations

import dataclasses

import pytest

from moe_lab.plan.config import compose
from moe_lab.plan.memory import GIB, plan_memory
from moe_lab.plan.planner import (
    ALLOCATOR_RESERVE,
    ALLOCATOR_RESERVE_EDGE,
    build_hardware,
    fits,
    plan,
    step_of,
    usable_device_bytes,
    validated,
)
from moe_lab.plan.records import allocator_reserve

FULL_DEPTH = ["+experiment=full_depth", "hardware=h200", "hardware.gpus_per_node=1"]


def step_and_hw(*overrides):
    cfg = compose(FULL_DEPTH + list(overrides))
    hw = build_hardware(cfg.hardware)
    return step_of(*validated(cfg, hw), hw), hw


def test_the_reserves_are_the_committed_records():
    """The median and the largest ratio of reserved to allocated memory over the records whose peak reached half
    their GPU; a new record at the edge that moves them fails here until the planner takes them."""
    median, largest = allocator_reserve()
    assert (ALLOCATOR_RESERVE, ALLOCATOR_RESERVE_EDGE) == (round(median, 3), round(largest, 3))
    assert 1 < ALLOCATOR_RESERVE < ALLOCATOR_RESERVE_EDGE


def test_fits_counts_reserved_memory():
    """A peak that fits allocated but not as the allocator reserves it does not fit, the message saying so."""
    step, hw = step_and_hw("ac=full")
    peak = plan_memory(step).peak
    tight = dataclasses.replace(hw, hbm_gib=(1.01 * peak) / GIB + hw.context_gib)  # 1 % over the allocated peak
    ok, why = fits(step, tight)
    assert not ok and "reserved" in why and f"x{ALLOCATOR_RESERVE}" in why
    roomy = dataclasses.replace(hw, hbm_gib=(1.05 * peak) / GIB + hw.context_gib)
    assert fits(step, roomy)[0]


def test_a_plan_near_the_gpus_memory_is_at_the_edge():
    """Fused + selective keeping everything at seq 16384 (about 127 GiB of 139.8) fits but is at the edge; fused +
    full AC (about 80) is not."""
    edge = plan(compose(FULL_DEPTH + ["ac=selective"]), search=False)["plan"]
    assert edge["fits"] and edge["at_edge"] and edge["fits_why"].startswith("at the edge: allocator retries likely")
    step, hw = step_and_hw("ac=selective")
    memory = plan_memory(step)
    assert ALLOCATOR_RESERVE * memory.peak <= usable_device_bytes(hw) < ALLOCATOR_RESERVE_EDGE * memory.peak
    room = plan(compose(FULL_DEPTH + ["ac=full"]), search=False)["plan"]
    assert room["fits"] and not room["at_edge"] and room["fits_why"] == "fits"
    assert room["memory"]["reserved_gib"] == pytest.approx(ALLOCATOR_RESERVE * room["memory"]["peak_gib"])


def test_host_memory_fits_per_node():
    """Host memory is a node's: its ranks' offloaded state and training processes together, whatever the job's
    other nodes hold. The same 8 ranks (offload=optimizer, the same state per rank) fit hosts that hold 6 ranks' worth
    as 2 nodes of 4, not as one node of 8, the message naming the node's need; hosts of 8 ranks' worth hold that."""
    from moe_lab.optim.offload.host import HOST_RESERVE
    from moe_lab.plan.planner import HOST_PROCESS

    def step_and_hw(nodes, per_node):
        cfg = compose(["model=qwen3_30b", "model.num_layers=2", "offload=optimizer", f"hardware.nodes={nodes}",
                       f"hardware.gpus_per_node={per_node}"])  # fmt: skip
        hw = build_hardware(cfg.hardware)
        return step_of(*validated(cfg, hw), hw), hw

    (two_nodes, hw), (one_node, _) = step_and_hw(2, 4), step_and_hw(1, 8)
    rank = plan_memory(two_nodes).host_total + HOST_PROCESS
    assert plan_memory(one_node).host_total + HOST_PROCESS == rank and rank > HOST_PROCESS

    def holding(ranks):  # a host whose memory usable by offload holds ``ranks`` ranks
        return dataclasses.replace(
            hw, host_memory_gib=(ranks * rank / GIB + hw.host_memory_in_use_gib) / (1 - HOST_RESERVE)
        )

    assert fits(two_nodes, holding(6)) == (True, "fits")
    ok, why = fits(one_node, holding(6))
    assert not ok and why == f"host: {8 * rank / GIB:.1f} GiB per node > {6 * rank / GIB:.1f} GiB usable"
    assert fits(one_node, holding(8.01)) == (True, "fits")
