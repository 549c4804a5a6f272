"""The planner's model of room at full depth (``dispatcher.save``, ``ac.keep``, ``ac.offload_activations``) against
the code it describes: what the fused op keeps per received row under each save mode, the recompute each setting
adds to the step, selective's kept sets, the device residency and host traffic of activation offload, and the
search for the fastest setting that fits per depth and sequence length. No model is built and no GPU is used."""

from __future__ import annotations

import dataclasses

import pytest

from moe_lab.config import ConfigError
from moe_lab.moe.fused.ops import SAVES
from moe_lab.parallel.ac import KEEP_SETS
from moe_lab.plan.config import compose
from moe_lab.plan.memory import GIB, offloaded_bytes, plan_memory, saved_per_layer
from moe_lab.plan.planner import (
    TIE,
    build_hardware,
    fastest_by_depth,
    fastest_fitting,
    fits,
    plan,
    room_settings,
    step_of,
    validated,
    with_setting,
)
from moe_lab.plan.step_time import GATE_UP_SHARE, grouped_shape_factor, offload_pace, plan_time

FULL_DEPTH = [
    "+experiment=benchmark",
    "model=qwen3_30b",
    "model.num_layers=48",
    "model.num_experts=16",
    "dispatcher=fused",
]


def step_and_hw(*overrides):
    return search_inputs(*overrides)[:2]


def search_inputs(*overrides):
    """The step, its hardware and the training config the searches validate their settings against."""
    cfg = compose(FULL_DEPTH + list(overrides))
    hw = build_hardware(cfg.hardware)
    train, options = validated(cfg, hw)
    return step_of(train, options, hw), hw, train


def test_save_modes_keep_what_the_op_returns():
    """The fused op's saved bytes drop by the rows each save mode leaves out (x_routed 2H, gate/up 4I per received
    row, as moe_lab.moe.fused.ops.SAVES names them), for every layer."""
    plans = {save: plan_memory(step_and_hw("ac=selective", f"dispatcher.save={save}")[0]) for save in SAVES}
    step, _ = step_and_hw("ac=selective")
    c, rows, layers = step.cfg, step.dispatcher.receive_rows(step), step.cfg.num_layers
    row_bytes = {"x_routed": 2 * c.hidden_size, "gate_up": 4 * c.moe_intermediate_size}
    kept = {save: plans[save].phases["loss"] for save in SAVES}
    for save, names in SAVES.items():
        dropped = sum(b for name, b in row_bytes.items() if name not in names)
        assert (kept["rows"] - kept[save]) * GIB == pytest.approx(layers * rows * dropped, rel=1e-9), save
    assert (
        plans["inputs"].categories["fused dispatcher buffers"]
        < 0.1 * plans["rows"].categories["fused dispatcher buffers"]
    )


def test_save_modes_pay_the_gate_up_gemm_and_the_gather():
    """rows_only adds the gate/up GEMM (2/3 of the experts' forward) to backward; gate_up the row gather; inputs
    both."""
    times = {save: plan_time(*step_and_hw("ac=selective", f"dispatcher.save={save}")) for save in SAVES}
    step, hw = step_and_hw("ac=selective")
    expert_forward = step.shapes.expert_flops(step.tokens) / (hw.flops("grouped_gemm") * grouped_shape_factor(step))
    extra = times["rows_only"]["seconds"]["expert_gemm"] - times["rows"]["seconds"]["expert_gemm"]
    assert extra == pytest.approx(GATE_UP_SHARE * expert_forward, rel=1e-9)
    assert times["inputs"]["seconds"]["expert_gemm"] == pytest.approx(times["rows_only"]["seconds"]["expert_gemm"])
    assert times["gate_up"]["seconds"]["expert_gemm"] == pytest.approx(times["rows"]["seconds"]["expert_gemm"])
    glue = {save: times[save]["seconds"]["dispatch_glue"] for save in SAVES}
    assert glue["gate_up"] == pytest.approx(glue["inputs"]) and glue["gate_up"] > glue["rows"] == glue["rows_only"]
    assert (
        times["rows"]["step_s"] < times["gate_up"]["step_s"] < times["rows_only"]["step_s"] < times["inputs"]["step_s"]
    )


def test_save_inputs_at_ep2_exchanges_the_rows_again():
    rows, inputs = (
        plan_time(*step_and_hw("parallel.ep=2", "hardware.gpus_per_node=2", "ac=selective", f"dispatcher.save={s}"))
        for s in ("rows", "inputs")
    )
    assert inputs["communication_s"]["ep_all_to_all"] == pytest.approx(rows["communication_s"]["ep_all_to_all"] * 5 / 4)


def test_keep_sets_trade_memory_for_recompute():
    """The default keep plans as before the key existed; leaving a set out drops its outputs from what is kept and
    adds its forward again to backward."""
    everything, _ = step_and_hw("ac=selective")
    default, _ = step_and_hw("ac=selective", "ac.keep=[matmul,grouped_mm,attention,router,dispatcher]")
    assert plan_memory(everything).peak == plan_memory(default).peak
    no_dispatcher, hw = step_and_hw("ac=selective", "ac.keep=[matmul,grouped_mm,attention,router]")
    no_attention, _ = step_and_hw("ac=selective", "ac.keep=[matmul,grouped_mm,router,dispatcher]")
    assert saved_per_layer(no_dispatcher) < saved_per_layer(everything) and saved_per_layer(
        no_attention
    ) < saved_per_layer(everything)
    base = plan_time(everything, hw)["seconds"]
    assert plan_time(no_attention, hw)["seconds"]["attention"] == pytest.approx(base["attention"] * 4.5 / 3.5)
    assert plan_time(no_dispatcher, hw)["seconds"]["expert_gemm"] == pytest.approx(base["expert_gemm"] * 4 / 3)
    assert plan_time(no_dispatcher, hw)["seconds"]["attention"] == pytest.approx(base["attention"])


def test_activation_offload_moves_all_but_the_last_layer_and_pays_pcie_beyond_compute():
    step, hw = step_and_hw("ac=selective", "dispatcher.save=inputs", "ac.offload_activations=true")
    kept, _ = step_and_hw("ac=selective", "dispatcher.save=inputs")
    assert offloaded_bytes(step) == pytest.approx((step.cfg.num_layers - 1) * saved_per_layer(kept))
    memory = plan_memory(step, offload_pace(step, hw))
    assert memory.host["pinned activations"] > offloaded_bytes(step)  # pinned blocks round up
    assert memory.phases["loss"] < plan_memory(kept).phases["loss"] - 10  # GiB, where every layer's are kept
    # infinitely fast PCIe: nothing exposed, every copy keeps pace; a fast one: the profile's share of the copies
    # shows; a slow one: exposed beyond compute, and memory stays behind
    fast = dataclasses.replace(hw, pcie_gbps=1e6, activation_offload_exposed=0.0)
    assert plan_time(step, fast)["seconds"]["pcie"] == 0 and offload_pace(step, fast) == 1.0
    copies = 2 * offloaded_bytes(step) / hw.pcie_bytes_per_s
    assert plan_time(step, hw)["seconds"]["pcie"] == pytest.approx(hw.activation_offload_exposed * copies)
    slow = dataclasses.replace(hw, pcie_gbps=1.0)
    compute = sum(
        plan_time(step, slow)["seconds"][k]
        for k in ("dense_gemm", "expert_gemm", "attention", "dispatch_glue", "other")
    )
    assert plan_time(step, slow)["seconds"]["pcie"] == pytest.approx(
        2 * offloaded_bytes(step) / slow.pcie_bytes_per_s - compute
    )
    assert plan_memory(step, offload_pace(step, slow)).peak > memory.peak


def test_offload_with_eager_selective_is_refused():
    with pytest.raises(ConfigError, match="ac.offload_activations"):
        plan(
            compose(FULL_DEPTH + ["ac=selective", "ac.offload_activations=true", "trainer.compile=false"]), search=False
        )


def test_fastest_fitting_is_the_fastest_setting_that_fits():
    step, hw, train = search_inputs("ac=selective")
    for row in fastest_by_depth(step, hw, train, [48], [16384, 32768]):
        shaped = dataclasses.replace(step, seq_len=row["seq_len"])
        timed = []
        for setting in room_settings(shaped, train):
            candidate = with_setting(shaped, setting)
            if fits(candidate, hw)[0]:
                timed.append(plan_time(candidate, hw)["step_s"])
        assert min(timed) <= row["fastest"]["s_per_step"] <= min(timed) * (1 + TIE), row
        full = plan_time(with_setting(shaped, {"ac": "full", "dispatcher.save": "rows"}), hw)["step_s"]
        assert row["fastest"]["s_per_step"] < full
    full = plan(compose(FULL_DEPTH + ["ac=full"]))
    assert full["plan"]["fastest_fitting"]["s_per_step"] < full["metrics"]["s_per_step"]


def test_of_tied_settings_the_one_with_more_room_is_chosen():
    """Fused + none and fused + selective (keeping everything) plan at the same step; the search picks selective,
    which leaves more memory, over none."""
    step, hw, train = search_inputs("ac=selective", "model.num_layers=8")
    tied = {
        ac: with_setting(step, {"ac": ac, **({"ac.keep": list(KEEP_SETS)} if ac == "selective" else {})})
        for ac in ("none", "selective")
    }
    times = {ac: plan_time(s, hw)["step_s"] for ac, s in tied.items()}
    assert times["none"] == pytest.approx(times["selective"], rel=TIE)
    assert plan_memory(tied["none"]).peak > plan_memory(tied["selective"]).peak
    assert "ac=none" not in fastest_fitting(step, hw, train)["overrides"]


def test_the_search_offers_what_the_options_accept():
    """The settings searched are those their options' own validate accepts: activation offload with ac=selective
    only compiled, with ac=none either way, never with ac=full (no such key)."""
    for compiled in (True, False):
        step, _, train = search_inputs("ac=selective", f"trainer.compile={str(compiled).lower()}")
        offloaded = {s["ac"] for s in room_settings(step, train) if s.get("ac.offload_activations")}
        assert offloaded == ({"none", "selective"} if compiled else {"none"})
