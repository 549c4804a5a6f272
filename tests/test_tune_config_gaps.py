"""What the mutation audit of ``moe_lab.tune``, ``moe_lab.config``, ``moe_lab.compare`` and ``moe_lab.results.tune``
found no test asserting, each checked against a reference worked out by hand, the planner's own plan, or the docs
(docs/tune.md, the docstrings): the tune group's own refusals, the values a point's name reads back as, a point's
row, the planning pool's size and chunks, the order of the points that do not fit, the first refusal of a space of
no valid point, where a measurement runs and what a resumed round reruns, the closest point of a space where
nothing fits, the report's counts, winner, order, plot, spans and notes, a tune's table for a candidate out of
memory, compare's band and compact table, validation's bounds, and --help's order and spelling."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pandas as pd
import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from moe_lab import compare
from moe_lab.config import ConfigError
from moe_lab.results.tune import PLANS, TUNE
from moe_lab.tune import measure as measuring
from moe_lab.tune import planning
from moe_lab.tune.space import Space, check_tune_overrides, override_value

# --- the space (moe_lab.tune.space) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"workers": 0}, "tune.workers"),  # >= 1 or null
        ({"dir": ""}, "tune.dir"),  # a tune must name its directory
        ({"axes": {"parallel.ep": "12"}}, "tune.axes.parallel.ep"),  # a bare value, not spanned as "1", "2"
        ({"axes": {"ac": []}}, "tune.axes.ac"),  # an axis of no value would leave no point
        ({"axes": {"trainer.steps": []}}, "tune.axes.trainer.steps"),
    ],
)
def test_the_tune_groups_own_settings_are_refused_naming_their_key(settings, key):
    with pytest.raises(ConfigError) as refused:
        Space(**({"axes": {"ac": ["full"]}, "dir": "tune"} | settings))
    assert refused.value.key == key


def test_the_tune_groups_settings_at_their_bounds_are_taken():
    space = Space(axes={"ac": ("none", "full"), "parallel.ep": [1, 2]}, measure=0, device="cpu", dir="t", workers=1)
    assert (space.axes, space.measure, space.workers) == ({"ac": ["none", "full"], "parallel.ep": [1, 2]}, 0, 1)


def test_a_new_axis_appended_with_plus_is_taken():
    """docs/tune.md: a new axis is ``+tune.axes.<group>=[...]``, the form the refusal of ``tune.axes.loss`` advises."""
    check_tune_overrides(["+tune.axes.loss=[full,chunked]", "tune.measure=0"], ["dispatcher", "ac"])
    with pytest.raises(ConfigError) as refused:
        check_tune_overrides(["tune.axes.loss=[full,chunked]"], ["dispatcher", "ac"])
    assert refused.value.key == "tune.axes.loss"


@pytest.mark.parametrize("value", [None, True, False, 2, 1.5, "fused", ["attention", "router"], [1, None]])
def test_a_points_values_read_back_as_themselves(value):
    """A point's name is the overrides that choose it: each value as Hydra's grammar reads it back (null, not the
    string "None")."""
    (override,) = OverridesParser.create().parse_overrides([f"key={override_value(value)}"])
    assert override.value() == value and type(override.value()) is type(value)


# --- planning (moe_lab.tune.planning) ------------------------------------------------------------------------------


def test_a_points_row_splits_the_planned_step_into_compute_and_exposed_communication():
    """The row a point gets is the planner's plan of it (``moe_lab.plan``): its exposed communication the sum of the
    plan's exposed collectives, its compute the rest of the step (what an emulated rank's measured part is checked
    against), its memory outside the allocator the sum of the plan's."""
    from moe_lab.plan.config import compose as compose_plan
    from moe_lab.plan.planner import plan

    cfg = compose_plan(["model=qwen3_30b", "model.num_layers=2", "data.seq_len=4096", "data.batch_size=1",
                        "trainer.nproc_per_node=2", "dispatcher=fused", "parallel.ep=2"])  # fmt: skip
    own = plan(cfg, search=False)
    exposed = sum(own["plan"]["exposed_communication_s"].values())
    assert exposed > 0  # EP 2 over two GPUs: all-to-all and FSDP collectives
    row = planning.plan_point(cfg, planning.hardware_of(cfg))
    assert row["status"] == "ok" and row["fits"] == own["plan"]["fits"]
    assert row["planned_s_per_step"] == pytest.approx(own["metrics"]["s_per_step"], rel=1e-12)
    assert row["planned_exposed_comm_s"] == pytest.approx(exposed, rel=1e-12)
    assert row["planned_compute_s"] == pytest.approx(own["metrics"]["s_per_step"] - exposed, rel=1e-12)
    outside = sum(own["plan"]["memory"]["outside_allocator_gib"].values())
    assert outside > 0 and row["planned_outside_allocator_gib"] == pytest.approx(outside, rel=1e-12)
    assert row["planned_device_total_gib"] == pytest.approx(own["plan"]["memory"]["device_total_gib"], rel=1e-12)
    assert row["planned_peak_host_rss_gib"] == pytest.approx(own["metrics"]["peak_host_rss_gib"], rel=1e-12)


def test_the_planning_processes_are_the_cores_at_most_four(monkeypatch):
    """docs/tune.md: ``tune.workers`` null is the machine's cores, at most 4; a number is taken as given."""
    monkeypatch.setattr(planning.os, "cpu_count", lambda: 16)
    assert planning.workers(None) == 4 and planning.workers(6) == 6
    monkeypatch.setattr(planning.os, "cpu_count", lambda: 3)
    assert planning.workers(None) == 3
    monkeypatch.setattr(planning.os, "cpu_count", lambda: None)  # unknown: one
    assert planning.workers(None) == 1


def test_a_combination_is_cut_into_tasks_of_at_most_a_chunk_every_point_once():
    keys = [[("parallel.ep", n)] for n in range(2 * planning.CHUNK + 5)]
    combination = planning.Combination(["ac=full"], OmegaConf.create({}), keys)
    tasks = planning.chunks([combination, planning.Combination(["ac=none"], OmegaConf.create({}), keys[:1])])
    assert [t.size for t in tasks] == [planning.CHUNK, planning.CHUNK, 5, 1]
    assert [k for t in tasks[:3] for k in t.keys] == keys and tasks[3].groups == ["ac=none"]


def test_the_points_that_do_not_fit_follow_the_ranked_ones_faster_first():
    """``rank``: the rest after the fitting, faster first; an invalid point (no planned rate) last."""
    rows = [
        {"point": "slow", "fits": False, "planned_tokens_per_s_per_gpu": 10.0},
        {"point": "invalid", "fits": False},
        {"point": "fits", "fits": True, "planned_tokens_per_s_per_gpu": 5.0, "planned_s_per_step": 2.0,
         "planned_peak_gpu_mem_gib": 10.0},
        {"point": "fast", "fits": False, "planned_tokens_per_s_per_gpu": 30.0},
    ]  # fmt: skip
    ranked = planning.rank(rows)
    assert [(r["point"], r["rank"]) for r in ranked] == [("fits", 1), ("fast", None), ("slow", None), ("invalid", None)]


def test_a_space_of_no_valid_point_is_refused_with_its_first_points_refusal(monkeypatch):
    """docs/tune.md: the refusal is the first point's (each group combination's first point validated in turn),
    not the last one's; one valid point anywhere and there is none."""
    refusals = {"a": ConfigError("parallel.ep", "first"), "b": ConfigError("trainer.steps", "second"), "c": None}
    monkeypatch.setattr(planning, "hardware_of", lambda cfg: None)
    monkeypatch.setattr(planning, "validation_error", lambda cfg, hw: refusals[cfg.name])

    def combos(*names):
        return [planning.Combination([f"x={n}"], OmegaConf.create({"name": n}), [[]]) for n in names]

    assert planning.invalid_space(combos("a", "b"), 1, progress=False) is refusals["a"]
    assert planning.invalid_space(combos("b", "a"), 1, progress=False) is refusals["b"]
    assert planning.invalid_space(combos("a", "c", "b"), 1, progress=False) is None


# --- measuring (moe_lab.tune.measure) ------------------------------------------------------------------------------


def _hw(name="h200", nodes=1, gpus_per_node=8):
    return SimpleNamespace(name=name, nodes=nodes, gpus_per_node=gpus_per_node, gpus=nodes * gpus_per_node)


@pytest.mark.parametrize(
    "hw, devices, emulated",
    [
        (_hw(nodes=1, gpus_per_node=8), 8, False),  # the machine holds the layout: real ranks
        (_hw(nodes=1, gpus_per_node=8), 16, False),
        (_hw(nodes=1, gpus_per_node=8), 4, True),  # larger than the machine
        (_hw(nodes=2, gpus_per_node=4), 8, True),  # spans nodes: emulated however many GPUs are here
    ],
)
def test_a_layout_is_emulated_where_it_is_larger_than_the_machine_or_spans_nodes(hw, devices, emulated):
    layout = measuring.layout_of(hw, "cuda", devices, "NVIDIA H200")
    assert (layout.emulated, layout.nodes, layout.gpus_per_node, layout.hardware) == (
        emulated, hw.nodes, hw.gpus_per_node, "h200"
    )  # fmt: skip


def test_a_measurement_that_cannot_stand_for_the_plan_is_refused():
    """docs/tune.md: measuring on an H100 for an h200 plan is refused (``hardware``), as is an emulated rank of a
    profile read from a file (its planned wire needs a named profile); a CPU measures the machinery, any profile."""
    with pytest.raises(ConfigError) as refused:
        measuring.layout_of(_hw(), "cuda", 8, "NVIDIA H100 80GB HBM3")
    assert refused.value.key == "hardware" and "h100" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        measuring.layout_of(_hw(name="h200_mine", gpus_per_node=2), "cpu", 1, "cpu")
    assert refused.value.key == "hardware"
    assert measuring.layout_of(_hw(name="h200_mine", gpus_per_node=1), "cpu", 1, "cpu").emulated is False
    assert measuring.layout_of(_hw(gpus_per_node=2), "cpu", 1, "cpu").emulated is True


def test_a_directory_holding_other_candidates_is_refused_and_left_as_it_was(tmp_path):
    assert measuring.write_candidates(tmp_path, ["ac=full", ""]) == ["ac=full", ""]
    written = (tmp_path / "candidates.yaml").read_text()
    measuring.write_candidates(tmp_path, ["ac=full", ""])  # the same tune resumed
    with pytest.raises(ConfigError) as refused:
        measuring.write_candidates(tmp_path, ["ac=none"])
    assert refused.value.key == "tune.dir" and (tmp_path / "candidates.yaml").read_text() == written


def _record(tune_dir, candidate, status):
    path = tune_dir / measuring.run_dir_of(candidate) / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"status": status, "config": {}}))


def _queue(planned: dict) -> planning.CandidateQueue:
    return planning.CandidateQueue(
        [{"rank": n, "same_plan_as": None, "point": p, "planned_peak_gpu_mem_gib": gib}
         for n, (p, gib) in enumerate(planned.items(), start=1)]
    )  # fmt: skip


def test_a_resumed_round_with_a_candidate_left_unrecorded_runs_again(tmp_path, monkeypatch):
    """A round is skipped only where every candidate ended ok or out of memory; one without a record reruns it."""
    runs = []

    def sweep(command, tune_dir, batch, log_path, bar):
        runs.append([c["point"] for c in batch])
        for candidate in batch:
            _record(tune_dir, candidate, "ok")
        return 0, 0.0

    monkeypatch.setattr(measuring, "_run", sweep)
    layout = measuring.Layout("cpu", 1, 2, "h200", emulated=True)
    queue = _queue({"p1": 50.0, "p2": 40.0})
    first = [queue.take(), queue.take()]
    _record(tmp_path, {"candidate": 1, "run_dir": "measured/0"}, "ok")  # a tune cut short after its first candidate
    measured = measuring.measure(tmp_path, [], layout, first, queue.take, lambda chosen: None, progress=False)
    assert runs == [["p1", "p2"]] and "skipped" not in measured["sweeps"][0]
    again = measuring.measure(tmp_path, [], layout, first, queue.take, lambda chosen: None, progress=False)
    assert runs == [["p1", "p2"]] and again["sweeps"][0]["skipped"] == "measured before"


def test_the_measurement_ends_as_the_first_round_that_failed(tmp_path, monkeypatch):
    """Round 1 exits 0 with a candidate out of memory, round 2 (its replacement) exits 1: the measurement's
    returncode is 1, not the first round's 0."""
    ends = {"p1": "oom", "p2": "ok", "p3": "error"}

    def sweep(command, tune_dir, batch, log_path, bar):
        for candidate in batch:
            _record(tune_dir, candidate, ends[candidate["point"]])
        return int(all(ends[c["point"]] != "ok" for c in batch)), 0.0

    monkeypatch.setattr(measuring, "_run", sweep)
    queue = _queue({"p1": 70.0, "p2": 60.0, "p3": 50.0})
    first = [queue.take(), queue.take()]
    layout = measuring.Layout("cpu", 1, 2, "h200", emulated=True)
    measured = measuring.measure(tmp_path, [], layout, first, queue.take, lambda chosen: None, progress=False)
    assert [(s["round"], s["returncode"]) for s in measured["sweeps"]] == [(1, 0), (2, 1)]
    assert measured["returncode"] == 1


# --- the report (moe_lab.tune.report) ------------------------------------------------------------------------------

PLANNED = pd.DataFrame(
    {
        "rank": [1, 2, None, None, None],
        "point": ["ac=full", "ac=none", "ac=selective", "parallel.ep=3", "parallel.ep=5"],
        "status": ["ok", "ok", "ok", "invalid", "error"],
        "fits": [True, True, False, False, False],
        "why": ["", "", "device: too much", "parallel.ep: must divide", "RuntimeError: a bug"],
        "same_plan_as": [None, None, None, None, None],
        "planned_s_per_step": [1.0, 1.2, 0.8, None, None],
        "planned_tokens_per_s_per_gpu": [200.0, 150.0, 300.0, None, None],
        "planned_peak_gpu_mem_gib": [60.0, 50.0, 200.0, None, None],
        "planned_compute_s": [0.9, 1.1, 0.7, None, None],
        "planned_outside_allocator_gib": [0.0, 0.0, 0.0, None, None],
    }
)


def _tune_dir(tmp_path, candidates=None, nodes=1):
    PLANNED.to_csv(tmp_path / PLANS, index=False)
    tune = {
        "title": "a test tune",
        "command": "python -m moe_lab.tune model=tiny",
        "train_overrides": ["model=tiny"],
        "hardware": {"name": "h200", "nodes": nodes, "gpus_per_node": 2, "usable_gib": 130.0,
                     "describe": f"{2 * nodes} x h200 ({nodes} node(s) x 2)"},
        "plan_seconds": 3.2,
        "measure_note": "Plan only (tune.measure=0): the best 3 planned below.",
        "candidates": candidates or [{"candidate": 1, "rank": 1, "point": "ac=full"},
                                     {"candidate": 2, "rank": 2, "point": "ac=none"}],
        "passed_over": [],
        "measured": None,
    }  # fmt: skip
    (tmp_path / TUNE).write_text(json.dumps(tune))
    return tmp_path


def test_the_report_counts_the_points_by_how_their_plan_ended(tmp_path):
    """Five points: two fit, one planned over the memory, one invalid, one the planner failed on; plan only, the
    candidates stand in the table as planned, and the winner is the best planned point."""
    from moe_lab.tune.report import report

    text, best = report(_tune_dir(tmp_path))
    assert (
        "5 points planned on 2 x h200 (1 node(s) x 2): 2 fit, 1 do not, 1 invalid, 1 failed to plan (3 s). Plan only"
        in text
    )
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert [row.split(" | ")[2] for row in rows] == ["ac=full", "ac=none"]
    assert all(row.endswith("| planned |") for row in rows)
    assert best["point"] == "ac=full" and "Winner (planned): `ac=full`" in text
    assert "python -m moe_lab.train model=tiny ac=full\n" in text and (tmp_path / "tune.png").is_file()


def test_the_plot_shows_the_fitting_frontier_and_counts_only_planned_points():
    """The frontier is of the fitting points alone (the faster point over the memory is not on it); an invalid or
    failed point has no plan to draw and is counted nowhere."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_lab.tune.report import figure

    df = PLANNED.assign(candidate=[1, 2, None, None, None])
    fig = figure(df, {"hardware": {"usable_gib": 130.0}, "title": "t"})
    try:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "planned, does not fit (1)" in labels and "planned, fits (2)" in labels
        (front,) = [line for line in ax.get_lines() if line.get_label() == "fitting frontier (planned)"]
        assert list(front.get_xdata()) == [50.0, 60.0] and list(front.get_ydata()) == [150.0, 200.0]
    finally:
        plt.close(fig)


def _measured(**columns):
    base = {"point": ["a", "b", "c"], "rank": [1, 2, 3], "candidate": [1, 2, 3], "replaces": [None, None, 1]}
    return pd.DataFrame(base | columns)


def test_the_winner_is_the_fastest_candidate_measured_ok():
    """Not the best planned one, nor one whose run failed whatever rate it logged before it did."""
    from moe_lab.tune.report import winner

    df = _measured(measured_status=["ok", "ok", "error"], measured_tokens_per_s_per_gpu=[100.0, 120.0, 500.0])
    best, by = winner(df)
    assert (best["point"], by) == ("b", "measured")


def test_the_measured_order_is_fastest_first_against_the_planned():
    from moe_lab.tune.report import order_note

    df = _measured(measured_status=["ok", "ok", "oom"], measured_tokens_per_s_per_gpu=[100.0, 120.0, None])
    assert order_note(df) == "measured order #2 > #1 differs from the planned #1 > #2"
    df["measured_tokens_per_s_per_gpu"] = [130.0, 120.0, None]
    assert order_note(df) == "measured order agrees with the planned order (#1 > #2)"
    df["measured_status"] = ["ok", "oom", "oom"]  # one measured ok: no order to tell
    assert order_note(df) is None


def test_ranks_passed_over_are_spans_one_line_per_reason():
    from moe_lab.tune.report import passed_over_lines, spans

    assert spans([1, 2, 3, 5, 7, 8]) == "1-3, 5, 7-8"  # the docstring's example
    assert spans([4]) == "4" and spans([2, 3]) == "2-3"
    passed = [
        {"rank": 1, "point": "precision=fp8", "why": "no torchao here"},
        {"rank": 2, "point": "precision=fp8 ac=full", "why": "no torchao here"},
        {"rank": 4, "point": "precision=fp8 ac=none", "why": "no torchao here"},
        {"rank": 3, "point": "offload=full", "why": "host buffers too large"},
    ]
    assert passed_over_lines(passed) == [
        "Not measured here: planned ranks 1-2, 4 (3 points; the first, `precision=fp8`): no torchao here.", "",
        "Not measured here: planned rank 3, `offload=full`: host buffers too large.", "",
    ]  # fmt: skip


# --- the tune's command (moe_lab.tune.__main__) --------------------------------------------------------------------

# A 2-layer 30B proxy on two H200, everything but the ac axis fixed (ac.keep spans selective's keep sets).
NARROW = ["model=qwen3_30b", "model.num_layers=2", "data.seq_len=4096", "data.batch_size=1",
          "trainer.nproc_per_node=2", "dispatcher=torch", "precision=bf16", "offload=none", "parallel.ep=1",
          "parallel.dp_replicate=1", "parallel.reshard_after_forward=true"]  # fmt: skip


def test_the_points_passed_over_are_those_before_the_lowest_ranked_candidate():
    from moe_lab.tune.__main__ import passed_before

    passed = [{"rank": 7, "point": "p7"}, {"rank": 3, "point": "p3"}, {"rank": 1, "point": "p1"}]
    assert [p["rank"] for p in passed_before(passed, [{"rank": 2}, {"rank": 5}])] == [1, 3]
    assert [p["rank"] for p in passed_before(passed, [])] == [1, 3, 7]  # nothing chosen: every one passed over


def test_without_a_gpu_the_candidates_are_the_best_measure_and_another_space_is_refused_its_directory(
    tmp_path, monkeypatch
):
    """``tune.measure=2`` on a machine without a GPU: planned only, the two best of distinct plans the candidates a
    GPU would measure. The same directory for another space (ac narrowed otherwise) is refused, nothing rewritten."""
    from moe_lab.tune.__main__ import run

    monkeypatch.setattr(measuring, "device_at_hand", lambda asked: (None, 0, "no GPU on this machine"))
    directory = tmp_path / "tune"
    run(NARROW + ["ac=none,full,selective", "tune.measure=2", f"tune.dir={directory}"], progress=False)
    tune = json.loads((directory / TUNE).read_text())
    plans = pd.read_csv(directory / PLANS)
    best = plans[plans["rank"].notna() & plans["same_plan_as"].isna()].sort_values("rank")["point"]
    assert [c["point"] for c in tune["candidates"]] == list(best[:2]) and len(best) > 2
    assert tune["measure_note"].startswith("No GPU on this machine: stopped after planning")
    held = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(ConfigError) as refused:
        run(NARROW + ["ac=none,full", "tune.measure=2", f"tune.dir={directory}"], progress=False)
    assert refused.value.key == "tune.dir" and "holds another tune" in str(refused.value)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == held


def test_a_space_of_which_nothing_fits_names_the_closest_point_and_the_largest_that_fits(tmp_path):
    """docs/tune.md: what is closest is the point of least device memory, with the longest ``data.seq_len`` (else
    the deepest ``model.num_layers``) at which it would fit and its offload mode, as the planner's search finds them."""
    from moe_lab.plan.config import compose as compose_plan
    from moe_lab.plan.planner import plan
    from moe_lab.tune.__main__ import run

    shared = ["+experiment=reference_30b", "trainer.nproc_per_node=1", "dispatcher=fused", "offload=none",
              "parallel.ep=1", "precision=bf16", "parallel.dp_replicate=1", "parallel.reshard_after_forward=true",
              "dispatcher.save=rows"]  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        run(shared + ["ac=none,full", "tune.measure=0", f"tune.dir={tmp_path}"], progress=False)
    plans = pd.read_csv(tmp_path / PLANS)
    assert not plans["fits"].any() and len(plans) == 2
    closest = plans.loc[plans["planned_device_total_gib"].idxmin(), "point"]
    farthest = plans.loc[plans["planned_device_total_gib"].idxmax(), "point"]
    message = str(refused.value)
    assert f"the closest, {closest}, does not fit" in message and farthest not in message
    largest = plan(compose_plan(shared + closest.split()), search=True)["plan"]["largest_fitting"]
    dimension = "seq_len" if any(fit["seq_len"] for fit in largest.values()) else "num_layers"
    most = max(fit[dimension] or 0 for fit in largest.values())
    mode = next(mode for mode, fit in largest.items() if fit[dimension] == most)
    key = "data.seq_len" if dimension == "seq_len" else "model.num_layers"
    assert refused.value.key == key and f"at {key} <= {most} it fits (offload={mode}" in message


# --- compare (moe_lab.compare) -------------------------------------------------------------------------------------


def _runs(n: int) -> pd.DataFrame:
    return pd.DataFrame({"status": ["ok"] * n, "error_message": [None] * n})


def test_the_spread_of_repeats_is_taken_only_where_all_of_them_have_a_value():
    repeats = pd.DataFrame({"ref": [1.0, 2.0, 3.0], "r1": [1.1, math.nan, 3.3], "r2": [0.9, 2.5, 3.0]})
    spread = compare.spread(repeats)
    assert list(spread.index) == [0, 2] and spread.tolist() == pytest.approx([0.2, 0.3])


def test_rtol_scales_with_the_size_of_the_reference_whatever_its_sign():
    """The band is atol + rtol * |reference|: a metric below zero gets the same band as its mirror above."""
    table = pd.DataFrame({"ref": [-2.0, -4.0], "run": [-2.001, -4.003]})
    (verdict,) = compare.check(table, _runs(2), None, 0.0, 1e-3, False)
    assert verdict.ok, verdict.message
    table["run"] = [-2.001, -4.005]  # 5e-3 at step 1, outside 4e-3
    (verdict,) = compare.check(table, _runs(2), None, 0.0, 1e-3, False)
    assert not verdict.ok and "leaves the band first at step 1" in verdict.message


def test_a_step_the_noise_band_does_not_reach_is_held_to_the_stated_envelope():
    """A band from repeats that start logging later has no value at the first steps: there the band is atol +
    rtol * |reference| alone, not unbounded."""
    table = pd.DataFrame({"ref": [3.0, 2.5, 2.0], "run": [3.5, 2.5, 2.0]})
    band = pd.Series([0.1, 0.1], index=[1, 2])
    (verdict,) = compare.check(table, _runs(2), band, 1e-3, 0.0, False)
    assert not verdict.ok and "leaves the band first at step 0" in verdict.message


def test_the_compact_table_keeps_the_first_and_last_steps_and_each_runs_largest_difference():
    """30 steps into 12 rows: spread over the run from the first to the last, plus the step where a run differs
    most (step 6, which the spread misses)."""
    ref = [3.0 - 0.05 * s for s in range(30)]
    table = pd.DataFrame({"ref": ref, "run": [v + (0.5 if s == 6 else 0.0) for s, v in enumerate(ref)]})
    view = compare.difference_table(table, None, rows=12)
    steps = list(view.index)
    assert steps[0] == 0 and steps[-1] == 29 and 6 in steps and len(steps) == 13
    assert view.loc[6, "diff run"] == pytest.approx(0.5)


def test_a_sweeps_view_without_repeats_has_no_noise_band(tmp_path):
    """``sweep_view`` (the notebook's): each ok point against the first; the noise band only where the sweep
    repeats the first point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = tmp_path / "sweep"
    for n, (lr, losses) in enumerate([(0.1, [3.0, 2.5, 2.0]), (0.2, [3.0, 2.4, 2.05]), (0.3, [3.0, 2.7, 1.7])]):
        _run_dir(sweep / str(n), losses, lr)
    try:
        summary = compare.sweep_view(compare.load_runs([sweep]))
    finally:
        plt.close("all")
    assert "noise band there" not in summary.columns
    assert summary["max |difference|"].tolist() == pytest.approx([0.1, 0.3])
    assert summary["at step"].tolist() == [1, 2]


def test_a_runs_largest_difference_is_the_largest_in_size_whatever_its_sign():
    table = pd.DataFrame({"ref": [3.0, 2.5, 2.0], "run": [3.0, 2.51, 1.9]})  # +0.01 at step 1, -0.1 at step 2
    (verdict,) = compare.check(table, _runs(2), None, 0.0, 0.0, False)
    assert verdict.ok and verdict.message.startswith("run: largest difference -1.000e-01 at step 2;")


def _run_dir(directory, losses, lr):
    directory.mkdir(parents=True)
    record = {"status": "ok", "error": None, "choices": {}, "overrides": [f"optimizer.lr={lr}"],
              "config": {"optimizer": {"lr": lr}}, "metrics": {}}  # fmt: skip
    (directory / "result.json").write_text(json.dumps(record))
    (directory / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n"
                                                     for s, v in enumerate(losses)))  # fmt: skip
    return str(directory)


def test_the_noise_factor_multiplies_the_band(tmp_path):
    """``--noise-factor 2`` over a 1e-3 envelope is a band of 2e-3: a run 2.5e-3 off leaves it, 1.5e-3 off does not."""
    ref = _run_dir(tmp_path / "ref", [3.0, 2.5, 2.0], 0.1)
    near = _run_dir(tmp_path / "near", [3.0, 2.5015, 2.0], 0.2)
    far = _run_dir(tmp_path / "far", [3.0, 2.5025, 2.0], 0.3)
    record = tmp_path / "noise.json"
    record.write_text(json.dumps({"envelope": 1e-3}))
    noise = ["--noise", str(record), "--noise-factor", "2"]
    assert compare.main([ref, near, *noise]) == 0 and compare.main([ref, far, *noise]) == 1


# --- a tune's table (moe_lab.results.tune) -------------------------------------------------------------------------


def test_a_candidate_that_ran_out_of_memory_has_no_planners_error_and_one_not_measured_no_record(tmp_path):
    """The planner's errors are measured / planned - 1 where there is a measurement: none for a run that ran out
    of memory (not 0, a perfect plan); a candidate whose run has no record yet gets no measured columns."""
    from moe_lab.results import load_tune

    directory = _tune_dir(tmp_path)
    (directory / "measured" / "0").mkdir(parents=True)
    record = {"status": "oom", "error": {"message": "CUDA out of memory"}, "config": {}, "metrics": {}}
    (directory / "measured" / "0" / "result.json").write_text(json.dumps(record))
    df = load_tune(directory).set_index("point")
    oom = df.loc["ac=full"]
    assert (oom["candidate"], oom["measured_status"], oom["measured_error"]) == (1, "oom", "CUDA out of memory")
    assert all(pd.isna(oom[k]) for k in ("measured_s_per_step", "step_error", "compute_error", "memory_error"))
    assert df.loc["ac=none", "candidate"] == 2
    assert pd.isna(df.loc["ac=none", "measured_status"]) and pd.isna(df.loc["ac=none", "run_dir"])


def test_the_note_names_only_the_rounds_that_left_candidates_without_a_record(tmp_path, monkeypatch):
    """Each round's sweep stood in for: round 1 exits 1 with its first candidate out of memory and its second
    without a record (the sweep died), round 2 exits 1 with its replacement out of memory, recorded. The note
    names round 1 (see measured.log), not round 2, whose candidates all have their record."""
    from moe_lab.tune.__main__ import run

    def sweep(command, tune_dir, batch, log_path, bar):
        for candidate in batch:
            if candidate["candidate"] != 2:
                _record(tune_dir, candidate, "oom")
        return 1, 0.0

    monkeypatch.setattr(measuring, "_run", sweep)
    fixed = ["dispatcher=torch", "offload=none", "precision=bf16", "parallel.dp_replicate=1"]
    run(["model=tiny", "trainer.nproc_per_node=2", "ac=none,full", "parallel.ep=1,2", *fixed,
         "parallel.reshard_after_forward=true,false", "tune.device=cpu", "tune.measure=2", f"tune.dir={tmp_path}"],
        progress=False)  # fmt: skip
    tune = json.loads((tmp_path / TUNE).read_text())
    rounds = [(s["round"], s["returncode"], s["unrecorded"]) for s in tune["measured"]["sweeps"]]
    assert rounds[:2] == [(1, 1, 1), (2, 1, 0)]
    note = tune["measure_note"]
    assert "Round 1's sweep exited 1 leaving 1 of its candidates without a record: see measured.log." in note
    assert "Round 2's" not in note and "Round 3's" not in note


# --- validation and --help (moe_lab.config) ------------------------------------------------------------------------


@pytest.fixture
def no_outer_launcher(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # validation reads the world size from an outer launcher


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.head_dim=63"], "model.head_dim"),  # rotary embeddings rotate pairs: an even head_dim
        (["model.rope_theta=0"], "model.rope_theta"),
        (["trainer.warmup_steps=-1"], "trainer.warmup_steps"),
        (["trainer.timing_skip=-1"], "trainer.timing_skip"),
        (["trainer.nproc_per_node=0"], "trainer.nproc_per_node"),
        (["trainer.peak_flops=0"], "trainer.peak_flops"),
        (["profile.warmup=-1"], "profile.warmup"),
        (["model.num_layers=true"], "model.num_layers"),  # a bool is no int, though Python counts it as one
    ],
)
def test_a_value_past_its_bound_is_refused_naming_its_key(compose_train, no_outer_launcher, overrides, key):
    from moe_lab import config

    with pytest.raises(ConfigError) as refused:
        config.validate(compose_train(*overrides))
    assert refused.value.key == key


def test_a_required_key_left_unset_is_named_as_required(compose_train, no_outer_launcher):
    """``data=tokens`` reads ``data.path``, which its yaml leaves ``???``: named, and said to be required."""
    from moe_lab import config

    with pytest.raises(ConfigError) as refused:
        config.validate(compose_train("data=tokens"))
    assert refused.value.key == "data.path"
    assert str(refused.value) == "data.path: is required: set it on the command line"


def test_help_lists_each_groups_default_option_first_and_values_as_yaml_spells_them():
    import yaml

    from moe_lab.config.help import help_text
    from moe_lab.config.schema import GROUPS
    from moe_lab.runtime.paths import CONF_DIR

    train = yaml.safe_load((CONF_DIR / "train.yaml").read_text())
    defaults = {group: option for d in train["defaults"] if isinstance(d, dict) for group, option in d.items()}
    lines = help_text().splitlines()
    for group, what in GROUPS.items():
        assert lines[lines.index(f"{group}: {what}") + 1].split()[0] == defaults[group], group
    text = "\n".join(lines)
    assert "  parallel.reshard_after_forward=true " in text and "  trainer.grad_clip=null " in text


def test_an_options_line_is_the_first_sentence_of_its_comment_without_hydras_directives():
    from moe_lab.config.help import option_line
    from moe_lab.runtime.paths import CONF_DIR, EXPERIMENTS_DIR

    assert option_line(CONF_DIR / "ac" / "none.yaml") == "Keep every activation."  # its comment goes on
    assert option_line(EXPERIMENTS_DIR / "benchmark.yaml").startswith("The settings every benchmark study shares;")
