"""``python -m moe_lab.tune``: a planning-only tune of a small layout against the planner's own plans of each point
(every point planned once, those that fit ranked by the plan's tokens/s/GPU), the default space against the options
and values that exist, bad input refused before any work naming its key, the stop after planning without a GPU,
and a measured tune of the tiny model on the CPU (one emulated rank of two) that ``moe_lab.results`` reads, the
notebook shows and the same command resumes."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sys

import pandas as pd
import pytest
import torch
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

import moe_lab.results
from moe_lab.config import ConfigError
from moe_lab.config.validate import options_of
from moe_lab.moe.fused.ops import SAVES
from moe_lab.parallel.ac import KEEP_SETS
from moe_lab.plan.config import compose as compose_plan
from moe_lab.plan.planner import plan
from moe_lab.results.tune import CANDIDATES, PLANS, TUNE
from moe_lab.runtime.paths import CONF_DIR
from moe_lab.tune import config as tune_config
from moe_lab.tune.__main__ import run
from moe_lab.tune.planning import CandidateQueue, rank
from moe_lab.tune.report import report
from moe_lab.tune.space import is_group
from tests.sweep import ROOT

# A 2-layer 30B proxy on two H200 at seq 4096: dispatcher x ac x EP (selective with two keep sets), the rest fixed
# (a group axis by its option, a key axis by its value).
SMALL = [
    "model=qwen3_30b",
    "model.num_layers=2",
    "data.seq_len=4096",
    "data.batch_size=1",
    "trainer.nproc_per_node=2",
    "dispatcher=torch,fused",
    "ac=none,full,selective",
    "ac.keep=[matmul,grouped_mm,attention,router,dispatcher],[attention,router]",
    "dispatcher.save=rows",
    "precision=bf16",
    "offload=none",
    "parallel.ep=1,2,3",
    "parallel.dp_replicate=1",
    "parallel.reshard_after_forward=true",
    "tune.measure=0",
]

# SMALL's layout with everything but the dispatcher and ac axes fixed.
NARROW = SMALL[:5] + [
    "precision=bf16",
    "offload=none",
    "parallel.ep=1",
    "parallel.dp_replicate=1",
    "parallel.reshard_after_forward=true",
    "tune.measure=0",
]


def small_points() -> list[list[str]]:
    """The SMALL space's points, written out by hand: keep sets only under selective, EP 3 (not dividing 2) too."""
    points = []
    for dispatcher, ac, ep in itertools.product(("torch", "fused"), ("none", "full", "selective"), (1, 2, 3)):
        keeps = [None, "[attention,router]"] if ac == "selective" else [None]
        for keep in keeps:
            point = [f"dispatcher={dispatcher}", f"ac={ac}"] + ([f"ac.keep={keep}"] if keep else [])
            points.append(point + ([f"parallel.ep={ep}"] if ep != 1 else []))
    return points


@pytest.fixture(scope="module")
def small_tune(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tune") / "small"
    run(SMALL + [f"tune.dir={directory}", "tune.workers=2"], progress=False)
    return directory


def test_a_planning_only_tune_plans_every_point_once(small_tune):
    plans = pd.read_csv(small_tune / PLANS)
    assert sorted(plans["point"]) == sorted(" ".join(p) for p in small_points())
    invalid = plans[plans["status"] == "invalid"]
    assert set(invalid["point"]) == {" ".join(p) for p in small_points() if "parallel.ep=3" in p}
    assert invalid["why"].str.startswith("parallel.ep").all()
    tune = json.loads((small_tune / TUNE).read_text())
    shown = plans[plans["rank"].notna() & plans["same_plan_as"].isna()].sort_values("rank")["point"][:3]
    assert [c["point"] for c in tune["candidates"]] == list(shown)  # plan only: the best 3, not measured
    assert tune["measured"] is None and "Plan only" in tune["measure_note"]
    assert (small_tune / "report.md").exists() and (small_tune / "tune.png").exists()
    assert not (small_tune / CANDIDATES).exists()


def test_the_ranking_is_the_planners_own(small_tune):
    """Each ranked point planned by ``moe_lab.plan`` on its own (composed from the overrides): the same tokens/s/GPU
    and peak, the ranks in order of tokens/s/GPU, and the winner's line the best of them."""
    plans = pd.read_csv(small_tune / PLANS)
    ranked = plans[plans["rank"].notna()].sort_values("rank")
    assert len(ranked) == (plans["status"] == "ok").sum() > 0  # everything valid fits here
    own = {}
    for point in plans[plans["status"] == "ok"]["point"]:
        cfg = compose_plan(SMALL[:5] + ["offload=none"] + point.split())  # the fixed keys are at their defaults
        metrics = plan(cfg, search=False)["metrics"]
        own[point] = (metrics["tokens_per_s_per_gpu"], metrics["peak_gpu_mem_gib"])
    for _, row in ranked.iterrows():
        assert row["planned_tokens_per_s_per_gpu"] == pytest.approx(own[row["point"]][0], rel=1e-9)
        assert row["planned_peak_gpu_mem_gib"] == pytest.approx(own[row["point"]][1], rel=1e-9)
    by_plan = sorted(own, key=lambda p: (-own[p][0], own[p][1]))
    assert [own[p] for p in ranked["point"]] == [own[p] for p in by_plan]
    report = (small_tune / "report.md").read_text()
    assert f"Winner (planned): `{ranked.iloc[0]['point']}`" in report
    assert "python -m moe_lab.train model=qwen3_30b model.num_layers=2" in report
    assert "tune." not in report.split("```bash")[1].split("```")[0]


def test_points_with_one_plan_all_point_to_its_first():
    """Ties of the very same plan: every later point names the first point's rank (not the point before it), the
    faster and the leaner rank first, and the queue takes one point of that plan."""

    def row(point, s_per_step, gib, fits=True):
        return {"point": point, "fits": fits, "planned_s_per_step": s_per_step, "planned_peak_gpu_mem_gib": gib,
                "planned_tokens_per_s_per_gpu": 1000.0 / s_per_step}  # fmt: skip

    rows = [row("a", 2.0, 50.0), row("b", 1.0, 60.0), row("c", 2.0, 50.0), row("d", 2.0, 40.0), row("e", 2.0, 50.0),
            row("f", 1.0, 99.0, fits=False)]  # fmt: skip
    ranked = rank(rows)
    assert [(r["point"], r["rank"], r["same_plan_as"]) for r in ranked] == [
        ("b", 1, None), ("d", 2, None), ("a", 3, None), ("c", 4, 3), ("e", 5, 3), ("f", None, None)
    ]  # fmt: skip
    queue = CandidateQueue(ranked)
    assert [queue.take()["point"] for _ in range(3)] == ["b", "d", "a"] and queue.take() is None


def test_the_candidates_are_the_best_measurable_of_each_plan():
    """In rank order, one point per plan (the first this machine can measure; those it cannot are passed over with
    why), and a replacement only among points planned to hold less than a bound (the tune's: what ran out of memory)."""
    rows = [  # rank, same plan as, planned peak
        (1, None, 70.0), (2, 1, 70.0), (3, None, 75.0), (4, None, 72.0), (5, None, 60.0), (6, None, 74.0)
    ]  # fmt: skip
    ranked = [{"rank": r, "same_plan_as": same, "planned_peak_gpu_mem_gib": gib, "point": f"p{r}"}
              for r, same, gib in rows] + [{"rank": None, "same_plan_as": None, "planned_peak_gpu_mem_gib": 1.0,
                                            "point": "does-not-fit"}]  # fmt: skip
    queue = CandidateQueue(ranked, lambda row: "refused here" if row["point"] in ("p1", "p4") else None)
    assert [queue.take()["point"] for _ in range(2)] == ["p2", "p3"]  # p1 refused: p2, of its plan, stands in
    assert queue.passed == [{"rank": 1, "point": "p1", "why": "refused here"}]
    assert queue.take(below_gib=75.0)["point"] == "p5"  # p4 refused: p5 is the best left below 75 GiB
    assert queue.take(below_gib=74.0) is None and queue.take()["point"] == "p6"
    assert queue.take() is None and [p["point"] for p in queue.passed] == ["p1", "p4"]


def test_the_report_names_why_the_planner_failed(small_tune, tmp_path):
    """A point the planner failed on is a bug, not a misfit: the report counts them and names the most frequent
    reason (every offload=full point once failed so, unseen, on the GPU machine's tunes)."""
    assert "The planner failed" not in (small_tune / "report.md").read_text()
    failing = tmp_path / "failing"
    shutil.copytree(small_tune, failing)
    plans = pd.read_csv(failing / PLANS)
    invalid = plans.index[plans["status"] == "invalid"][:3]
    plans.loc[invalid, "status"] = "error"
    plans.loc[invalid, "why"] = ["RuntimeError: the first"] * 2 + ["ValueError: the second"]
    plans.to_csv(failing / PLANS, index=False)
    text, _ = report(failing)
    assert "3 failed to plan" in text
    assert "The planner failed on 3 points; the most frequent reason (2 of them): `RuntimeError: the first`" in text


def test_the_default_space_covers_what_exists():
    """conf/tune/default.yaml: the group axes hold all their group's options (precision among them), the save modes
    are the fused op's, the keep sets are sets selective AC has, from all of them down."""
    axes = yaml.safe_load((CONF_DIR / "tune" / "default.yaml").read_text())["axes"]
    for name, values in axes.items():
        if is_group(name):
            assert sorted(values) == options_of(name), name
    assert sorted(axes["dispatcher.save"]) == sorted(SAVES)
    assert axes["ac.keep"][0] == list(KEEP_SETS) and all(set(k) <= set(KEEP_SETS) for k in axes["ac.keep"])
    assert {"dispatcher", "ac", "offload", "precision"} <= {name for name in axes if is_group(name)}


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["+tune.axes.bogus=[a]"], "tune.axes.bogus"),  # neither a group nor a dotted key
        (["dispatcher=torch,nope"], "dispatcher"),  # no such option
        (["offload=optimiser"], "offload"),  # no such option, fixed (train's and plan's check, before composing)
        (["dispatcher.sav=rows"], "dispatcher.sav"),  # no dispatcher option has this key
        (["trainer.stpes=3"], "trainer.stpes"),  # not a schema key
        (["trainer.steps=1,2"], "trainer.steps"),  # a sweep of something that is not an axis
        (["~tune.axes", "+tune.axes={dispatcher:[fused],dispatcher.sav:[rows]}"], "tune.axes.dispatcher.sav"),
        (["tune.measure=-1"], "tune.measure"),
        (["tune.mesure=3"], "tune.mesure"),  # not a key of the tune
        (["tune.axes.loss=[full,chunked]"], "tune.axes.loss"),  # a new axis without +
        (["tune.axes.ac.keep=[[attention,router]]"], "tune.axes.ac.keep"),  # a dotted axis as a path
        (["tune.device=tpu"], "tune.device"),
        (["tune.measure=1,2"], "tune.measure"),  # one tune: a sweep of its keys would be dropped
        (["tune.axes.ac=full"], "tune.axes.ac"),  # not a list: would be searched as its characters
        (["parallel.emulate=true"], "parallel.emulate"),
        (["-m"], "-m"),
    ],
)
def test_bad_input_is_refused_before_any_work(tmp_path, overrides, key):
    directory = tmp_path / "tune"
    with pytest.raises(ConfigError) as refused:
        run(["model=qwen3_30b", "model.num_layers=2", f"tune.dir={directory}"] + overrides, progress=False)
    assert refused.value.key == key
    assert not directory.exists()


def refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as refused:
        run(overrides, progress=False)
    return str(refused.value)


def test_a_misspelt_tune_key_is_refused_naming_what_exists(tmp_path):
    """Not Hydra's advice to append it with +: the tune's keys, or the option's axes and the override that adds an
    axis, which composes as advised (a dotted key as one key of the tune.axes dict)."""
    directory = f"tune.dir={tmp_path / 'tune'}"
    allowed = "axes, measure, device, dir, workers"
    assert refusal(["tune.mesure=3", directory]) == f"tune.mesure: unknown key of the tune; allowed: {allowed}"
    axes = ", ".join(yaml.safe_load((CONF_DIR / "tune" / "default.yaml").read_text())["axes"])
    assert refusal(["tune.axes.loss=[full]", directory]) == (
        f"tune.axes.loss: no such axis (axes: {axes}); a new axis is added with +tune.axes.loss=[...]"
    )
    assert "added with '+tune.axes={trainer.compile:[...]}'" in refusal(["tune.axes.trainer.compile=[true]", directory])
    assert "set it with '+tune.axes={ac.keep:[...]}'" in refusal(["+tune.axes.ac.keep=[[router]]", directory])
    advised = tune_config.compose(["+tune.axes.loss=[full]", "+tune.axes={trainer.compile:[true],ac.keep:[[router]]}"])
    assert {k: advised.tune.axes[k] for k in ("loss", "trainer.compile", "ac.keep")} == {
        "loss": ["full"], "trainer.compile": [True], "ac.keep": [["router"]]
    }  # fmt: skip


@pytest.mark.parametrize(
    "overrides, planned",
    [
        (["dispatcher=fused", "dispatcher.save=rows,input"], ["dispatcher=fused", "dispatcher.save=input"]),
        (
            ["dispatcher=torch", "ac=selective", "ac.keep=[attention,routr]"],
            ["ac=selective", "ac.keep=[attention,routr]"],
        ),
        (  # a value of the tune's option
            ["dispatcher=fused", "~tune.axes", "+tune.axes={ac:[full],dispatcher.save:[input]}"],
            ["dispatcher=fused", "dispatcher.save=input"],
        ),
    ],
)
def test_a_misspelt_value_of_an_options_key_is_refused_as_plan_refuses_it(tmp_path, overrides, planned):
    """Not planned as invalid at every point it reaches: refused before any work, naming the key."""
    directory = tmp_path / "tune"
    with pytest.raises(ConfigError) as refused_by_plan:
        plan(compose_plan(NARROW[:5] + planned))
    assert refusal(NARROW + overrides + [f"tune.dir={directory}"]) == str(refused_by_plan.value)
    assert not directory.exists()


@pytest.mark.parametrize(
    "setting, key, message",
    [
        ("trainer.steps=-1", "trainer.steps", "must be >= 1, got -1"),  # every point shares it
        ("parallel.ep=3", "parallel.ep", "must be >= 1 and divide the job's 2 ranks"),  # an axis fixed where none is
    ],
)
def test_a_space_of_no_valid_point_is_refused_before_planning(tmp_path, monkeypatch, setting, key, message):
    """Validated, not planned, nothing written: the refusal is the space's first point's, as after planning."""
    monkeypatch.setattr("moe_lab.tune.__main__.plan_all", lambda *args: pytest.fail("planned"))
    directory = tmp_path / "tune"
    space = [o for o in SMALL if not o.startswith("parallel.ep=")]  # EP the default axis: past the first pass
    with pytest.raises(ConfigError) as refused:
        run(space + [setting, f"tune.dir={directory}", "tune.workers=2"], progress=False)
    assert refused.value.key == key
    assert str(refused.value).startswith(f"{key}: no point of the space is valid; the first: {message}")
    assert not directory.exists()


def test_a_valid_point_past_the_first_pass_is_planned(tmp_path):
    """EP 3 (not dividing 2 ranks) is every combination's first point: the search goes on to EP 2, and plans."""
    run(NARROW + ["dispatcher=torch", "ac=none,full", "parallel.ep=3,2", f"tune.dir={tmp_path}"], progress=False)
    plans = pd.read_csv(tmp_path / PLANS).set_index("point")
    assert plans["status"].to_dict() == {
        "ac=none parallel.ep=3": "invalid", "ac=full parallel.ep=3": "invalid",
        "ac=none parallel.ep=2": "ok", "ac=full parallel.ep=2": "ok",
    }  # fmt: skip


def test_the_point_of_no_overrides_is_the_commands_own(tmp_path):
    """Every axis fixed on the command line leaves one point, of no overrides: load_tune reads its empty name back
    as "" (not NaN), the report names it as the command's own settings, its train line is the command's own, and
    measured it is a candidate of no overrides."""
    fixed = NARROW + ["dispatcher=torch", "ac=full"]
    run(fixed + [f"tune.dir={tmp_path}"], progress=False)
    assert list(moe_lab.results.load_tune(tmp_path)["point"]) == [""]
    text = (tmp_path / "report.md").read_text()
    assert "| the command's own settings |" in text and "Winner (planned): the command's own settings\n" in text
    shared = [o for o in fixed if not o.startswith(("parallel.", "tune."))]  # the key axes fixed: left to the point
    assert "python -m moe_lab.train " + " ".join(shared) + "\n```" in text

    # imported after a compose: Hydra's plugin scan re-executes the sweeper modules, BasicSweeper among them
    from hydra_plugins.moe_lab_tune.candidate_sweeper import CandidateSweeper
    from moe_lab.tune import measure as measuring

    measuring.write_candidates(tmp_path, [""])
    sweeper = CandidateSweeper(str(tmp_path / CANDIDATES))
    assert sweeper.split_arguments(OverridesParser.create().parse_overrides(shared), None) == [[shared]]


def test_a_layout_that_fits_nowhere_names_what_is_closest(tmp_path):
    overrides = ["+experiment=reference_30b", "trainer.nproc_per_node=1", "dispatcher=fused", "ac=none,full"]
    overrides += ["offload=none", "parallel.ep=1", "precision=bf16", "parallel.dp_replicate=1"]
    overrides += ["parallel.reshard_after_forward=true", "dispatcher.save=rows", f"tune.dir={tmp_path}"]
    with pytest.raises(ConfigError) as refused:
        run(overrides + ["tune.measure=0"], progress=False)
    key, message = refused.value.key, str(refused.value)
    assert key in ("data.seq_len", "model.num_layers") and "the closest, ac=" in message
    assert f"at {key} <= " in message and "it fits (offload=" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stop is of a machine without a GPU")
def test_without_a_gpu_it_stops_after_planning(tmp_path):
    directory = tmp_path / "tune"
    narrow = [o for o in SMALL if o != "tune.measure=0"] + ["parallel.ep=1", "ac=full"]
    run(narrow + [f"tune.dir={directory}", "tune.measure=2"], progress=False)
    tune = json.loads((directory / TUNE).read_text())
    assert "No GPU on this machine: stopped after planning" in tune["measure_note"]
    assert tune["measured"] is None and not (directory / "measured").exists()
    with pytest.raises(ConfigError) as refused:
        run(narrow + [f"tune.dir={tmp_path / 'cuda'}", "tune.device=cuda"], progress=False)
    assert refused.value.key == "tune.device"


def test_replacements_hold_less_than_any_candidate_that_ran_out_of_memory(tmp_path, monkeypatch):
    """Candidates planned at 75 and 70 GiB run out of memory: both replacements are planned below 70 (the 72 GiB
    point, below 75, would miss as the 70 did); a replacement that runs out lowers the bound again; at most as many
    replacements as candidates. Each round's records are written by a stand-in for its sweep; what a sweep left
    without a record is counted."""
    from moe_lab.tune import measure as measuring

    planned = {"p1": 75.0, "p2": 60.0, "p3": 70.0, "p4": 72.0, "p5": 69.0, "p6": 66.0, "p7": 68.5, "p8": 50.0}
    ends = {"p1": "oom", "p3": "oom", "p5": "oom", "p6": "oom", "p8": None}  # the rest ok; p8's sweep dies first

    def sweep(command, tune_dir, batch, log_path, bar):
        for candidate in batch:
            if (end := ends.get(candidate["point"], "ok")) is None:
                return 1, 0.0
            record = tune_dir / measuring.run_dir_of(candidate) / "result.json"
            record.parent.mkdir(parents=True)
            record.write_text(json.dumps({"status": end, "config": {}}))
        return int(all(ends.get(c["point"], "ok") != "ok" for c in batch)), 0.0  # none ended ok: the sweep exits 1

    monkeypatch.setattr(measuring, "_run", sweep)
    queue = CandidateQueue(
        [{"rank": n, "same_plan_as": None, "point": p, "planned_peak_gpu_mem_gib": gib}
         for n, (p, gib) in enumerate(planned.items(), start=1)]
    )  # fmt: skip
    layout = measuring.Layout("cpu", 1, 2, "h200", emulated=True)
    first = [queue.take() for _ in range(3)]
    measured = measuring.measure(tmp_path, [], layout, first, queue.take, lambda chosen: None, progress=False)
    assert [(s["round"], s["returncode"], s["unrecorded"]) for s in measured["sweeps"]] == [
        (1, 0, 0),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert yaml.safe_load((tmp_path / "candidates_2.yaml").read_text()) == [["p5"], ["p6"]]  # not p4: 72 >= 70
    assert yaml.safe_load((tmp_path / "candidates_3.yaml").read_text()) == [["p8"]]  # below p6's 66, the last allowed


def test_replacements_stop_at_as_many_as_the_first_candidates(tmp_path, monkeypatch):
    """Two candidates, the first out of memory: its replacement runs out too, and so does that one's; two
    replacements in all (as many as the first candidates) and the tune stops, the best point left (p5, planned below
    every one that ran out) unmeasured."""
    from moe_lab.tune import measure as measuring

    planned = {"p1": 80.0, "p2": 75.0, "p3": 70.0, "p4": 60.0, "p5": 50.0, "p6": 40.0}
    ends = {"p1": "oom", "p3": "oom", "p4": "oom"}  # the rest ok

    def sweep(command, tune_dir, batch, log_path, bar):
        for candidate in batch:
            record = tune_dir / measuring.run_dir_of(candidate) / "result.json"
            record.parent.mkdir(parents=True)
            record.write_text(json.dumps({"status": ends.get(candidate["point"], "ok"), "config": {}}))
        return 0, 0.0

    monkeypatch.setattr(measuring, "_run", sweep)
    queue = CandidateQueue(
        [{"rank": n, "same_plan_as": None, "point": p, "planned_peak_gpu_mem_gib": gib}
         for n, (p, gib) in enumerate(planned.items(), start=1)]
    )  # fmt: skip
    rounds = []
    layout = measuring.Layout("cpu", 1, 2, "h200", emulated=True)
    first = [queue.take() for _ in range(2)]
    measured = measuring.measure(tmp_path, [], layout, first, queue.take, lambda c: rounds.append(list(c)), False)
    assert [s["round"] for s in measured["sweeps"]] == [1, 2, 3]
    assert [(c["point"], c["replaces"]) for c in rounds[-1]] == [("p1", None), ("p2", None), ("p3", 1), ("p4", 3)]
    assert not (tmp_path / "candidates_4.yaml").exists() and queue.take()["point"] == "p5"


TINY_CPU = [
    "model=tiny",
    "trainer.steps=3",
    "trainer.timing_skip=1",
    "trainer.nproc_per_node=2",  # a 2-rank layout, measured as one emulated rank on the CPU
    "dispatcher=torch,fused",
    "ac=none,full",
    "offload=none",
    "precision=bf16",
    "parallel.dp_replicate=1",
    "parallel.reshard_after_forward=true",
    "dispatcher.save=rows,inputs",
    "parallel.ep=1,2",
    "tune.device=cpu",
    "tune.measure=2",
]


@pytest.mark.slow
def test_a_measured_tune_on_cpu_is_a_sweep_that_results_read_and_resume(tmp_path, monkeypatch):
    """The first candidate runs out of memory (tests/sweep.py injects it): the best point left planned to hold less
    is measured in its place, in a sweep of its own, the report before that round already shows the first round's
    (what a tune cut short keeps), and the same command afterwards runs nothing again."""
    from moe_lab.tune import measure as measuring

    sweep_command = measuring.sweep_command  # each round's sweep through tests/sweep.py, which injects the failure
    monkeypatch.setattr(measuring, "sweep_command", lambda *a: [sys.executable, str(ROOT / "tests" / "sweep.py"),
                                                                *sweep_command(*a)[3:]])  # fmt: skip
    reports_before_rounds, run_round = [], measuring._run

    def reporting_run(command, tune_dir, *rest):
        reports_before_rounds.append((tune_dir / "report.md").read_text())
        return run_round(command, tune_dir, *rest)

    monkeypatch.setattr(measuring, "_run", reporting_run)
    monkeypatch.setenv("MOE_LAB_INJECT", json.dumps([["oom", {"dispatcher": "torch"}]]))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the script runs from tests/, the package from the checkout
    directory = tmp_path / "tune"
    run(TINY_CPU + [f"tune.dir={directory}"], progress=False)
    tune = json.loads((directory / TUNE).read_text())
    assert tune["measured"]["returncode"] == 0 and tune["measured"]["layout"]["emulated"]
    assert [s["round"] for s in tune["measured"]["sweeps"]] == [1, 2]
    assert "| not measured |" in reports_before_rounds[0] and "| oom |" in reports_before_rounds[1]
    candidates = tune["candidates"]
    points = [c["point"] for c in candidates]
    assert points[0].startswith("dispatcher=torch") and not any(p.startswith("dispatcher=torch") for p in points[1:])
    assert [(c["candidate"], c["replaces"], c["run_dir"]) for c in candidates] == [
        (1, None, "measured/0"), (2, None, "measured/1"), (3, 1, "measured_2/0")
    ]  # fmt: skip
    assert yaml.safe_load((directory / CANDIDATES).read_text()) == [p.split() for p in points[:2]]
    plans = pd.read_csv(directory / PLANS).set_index("point")
    below = plans[
        (plans["rank"] > plans.loc[points[1], "rank"])
        & plans["same_plan_as"].isna()
        & (plans["planned_peak_gpu_mem_gib"] < plans.loc[points[0], "planned_peak_gpu_mem_gib"])
    ]
    assert points[2] == below.sort_values("rank").index[0]  # the best point left planned to hold less than #1
    assert yaml.safe_load((directory / "candidates_2.yaml").read_text()) == [points[2].split()]

    records = moe_lab.results.load(directory)  # the measured sweeps' records, as any sweep's
    assert list(records["status"]) == ["oom", "ok", "ok"] and records["emulated"].notna().all()
    for point, (_, record) in zip(points, records.iterrows()):
        assert set(point.split()) <= set(record["overrides"].split())
    table = moe_lab.results.load_tune(directory)
    measured = table[table["candidate"].notna()].sort_values("candidate")
    assert list(measured["point"]) == points and list(measured["measured_status"]) == ["oom", "ok", "ok"]
    ok = measured[measured["measured_status"] == "ok"]
    assert (ok["measured_s_per_step"] > 0).all() and ok["step_error"].notna().all()
    report = (directory / "report.md").read_text()
    assert "Winner (measured)" in report and "emulated on one cpu" in report and "| ok, in place of #1 |" in report
    assert f"Winner (measured): `{points[0]}`" not in report

    papermill = pytest.importorskip("papermill")
    notebook = tmp_path / "tune.ipynb"  # notebooks/sweep_analysis.ipynb shows the tune beside its records
    papermill.execute_notebook(
        ROOT / "notebooks" / "sweep_analysis.ipynb", notebook, parameters={"SWEEP": str(directory)}, cwd=ROOT,
        kernel_name="python3", progress_bar=False,
    )  # fmt: skip
    shown = notebook.read_text()
    assert '"output_type": "error"' not in shown and "winner (measured): python -m moe_lab.train model=tiny" in shown

    first = {p: os.path.getmtime(p) for p in directory.glob("measured*/*/result.json")}
    run(TINY_CPU + [f"tune.dir={directory}"], progress=False)  # the same command: the sweeps resume, nothing reruns
    assert {p: os.path.getmtime(p) for p in directory.glob("measured*/*/result.json")} == first and len(first) == 3
    held = {p: p.read_bytes() for p in directory.iterdir() if p.is_file()}
    with pytest.raises(ConfigError) as refused:  # another space into the same directory: refused, nothing rewritten
        run([o for o in TINY_CPU if not o.startswith("ac=")] + ["ac=full", f"tune.dir={directory}"], progress=False)
    assert refused.value.key == "tune.dir" and "holds another tune" in str(refused.value)
    assert {p: p.read_bytes() for p in directory.iterdir() if p.is_file()} == held


@pytest.mark.slow
def test_a_candidate_this_machine_refuses_is_passed_over(tmp_path):
    """The planner (an H200's target) takes the fused op's gpu backend; this CPU refuses it: the next point of the
    same plan (backend auto, the reference here) is measured instead, and the report says why."""
    space = ["~tune.axes", "+tune.axes={dispatcher:[fused],dispatcher.backend:[gpu,auto]}"]
    shape = ["model=tiny", "model.hidden_size=128", "model.moe_intermediate_size=128"]  # the gpu backend's tiles
    run(shape + ["trainer.steps=2", "trainer.timing_skip=0", "tune.device=cpu", "tune.measure=1", f"tune.dir={tmp_path}"]
        + space, progress=False)  # fmt: skip
    tune = json.loads((tmp_path / TUNE).read_text())
    assert [(p["rank"], p["point"]) for p in tune["passed_over"]] == [(1, "dispatcher=fused dispatcher.backend=gpu")]
    assert "dispatcher.backend: gpu needs a CUDA device" in tune["passed_over"][0]["why"]
    assert [c["point"] for c in tune["candidates"]] == ["dispatcher=fused"]
    assert "Not measured here: planned rank 1" in (tmp_path / "report.md").read_text()


def test_the_winners_line_on_several_nodes_is_an_srun_of_the_planned_mesh():
    """Run as printed, a multi-node winner would start one node's ranks: its line is an srun of every node, one task
    per GPU; on one node it is the job that starts its own ranks."""
    from moe_lab.tune.report import train_line

    tune = {"train_overrides": ["+experiment=reference_235b", "trainer.nproc_per_node=8"]}
    tune["hardware"] = {"nodes": 4, "gpus_per_node": 8}
    assert train_line(tune, "ac=full dispatcher=fused") == (
        "srun --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 "
        "python -m moe_lab.train +experiment=reference_235b trainer.nproc_per_node=8 ac=full dispatcher=fused"
    )
    tune["hardware"] = {"nodes": 1, "gpus_per_node": 8}
    assert train_line(tune, "") == "python -m moe_lab.train +experiment=reference_235b trainer.nproc_per_node=8"


def test_help_shows_the_tune_groups_keys_and_axes():
    """``python -m moe_lab.tune --help``: the usage, then the default space as conf/tune/ has it: every key of the
    tune with its default and every axis."""
    from moe_lab.tune.__main__ import help_text
    from moe_lab.tune.space import TUNE_KEYS

    text = help_text()
    assert text.startswith("``python -m moe_lab.tune``")
    default = yaml.safe_load((CONF_DIR / "tune" / "default.yaml").read_text())
    for key in TUNE_KEYS:
        if key != "axes":
            assert f"\n{key}: " in text, key
    for axis in default["axes"]:
        assert f"\n  {axis}:" in text, axis


def test_a_layout_says_where_it_measures():
    """The report's "measured as ...": an emulated rank, the GPUs themselves, or (tune.device=cpu) CPU processes, not
    the profile's GPUs."""
    from moe_lab.tune.measure import Layout as layout

    assert layout("cuda", 1, 8, "h200", emulated=False).describe() == "8 x h200 (1 x 8) on real ranks"
    assert layout("cpu", 1, 2, "h200", emulated=False).describe() == "the 2 x h200 (1 x 2) layout's ranks on the CPU"
    assert layout("cuda", 4, 8, "h200", emulated=True).describe() == "rank 0 of 32 x h200 (4 x 8), emulated on one cuda"


def test_each_rounds_sweep_keeps_the_launchers_overrides_and_takes_the_layouts(tmp_path):
    """A round's sweep (``python -m moe_lab.train -m`` over the round's candidates file, into its directory) runs the
    command line's overrides with its launcher's (``hydra/launcher``, ``hydra.launcher.*``: where the candidates
    run), the layout's in place of the command line's ranks; not the planner's hardware nor Hydra's other
    settings."""
    from moe_lab.tune.measure import Layout, sweep_command, train_overrides

    base = ["+experiment=reference_30b", "hardware=h200", "hardware.nodes=2", "trainer.nproc_per_node=4",
            "hydra/launcher=slurm", "hydra.launcher.partition=h200", "hydra.run.dir=elsewhere", "model.num_layers=4"]  # fmt: skip
    layout = Layout("cuda", 2, 8, "h200", emulated=True)
    command = sweep_command(tmp_path, base, layout, round_number=2)
    assert command[:4] == [sys.executable, "-m", "moe_lab.train", "-m"]
    assert command[4:] == [
        "+experiment=reference_30b", "hydra/launcher=slurm", "hydra.launcher.partition=h200", "model.num_layers=4",
        "trainer.nproc_per_node=8", "parallel.emulate=true", "parallel.emulate_nodes=2",
        "parallel.emulate_hardware=h200", "hydra/sweeper=candidates",
        f"hydra.sweeper.candidates={tmp_path.resolve() / 'candidates_2.yaml'}",
        f"hydra.sweep.dir={tmp_path.resolve() / 'measured_2'}",
    ]  # fmt: skip
    # the winner's line is one run: a launcher's overrides would be ignored there (Hydra launches sweeps only)
    assert train_overrides(base, sweep=False) == [
        "+experiment=reference_30b",
        "trainer.nproc_per_node=4",
        "model.num_layers=4",
    ]


def test_a_candidate_whose_nodes_host_buffers_exceed_the_free_memory_is_not_measured_here(monkeypatch):
    """The host buffers a point plans per rank (its host memory less the process's own), times the ranks of a node
    (4 here, of an emulated 2 x 4: the node the emulated rank stands for, not the job), against the host memory free
    on this machine (100 GiB here)."""
    from moe_lab.plan.hardware import GIB
    from moe_lab.plan.planner import HOST_PROCESS
    from moe_lab.tune import measure as measuring

    monkeypatch.setattr(measuring, "usable_host_bytes", lambda: 100 * GIB)
    unmeasurable = measuring.unmeasurable_here(measuring.Layout("cpu", 2, 4, "h200", emulated=True), ["model=tiny"])

    def why(buffers_gib):
        return unmeasurable(
            {"point": "offload=optimizer", "planned_peak_host_rss_gib": HOST_PROCESS / GIB + buffers_gib}
        )

    assert why(24.5) is None
    assert why(25.5) == "its node's host buffers, 102 GiB, exceed the 100 GiB free on this machine"


def test_a_profile_file_is_taken_as_plan_takes_it(tmp_path, monkeypatch):
    """``hardware=<profile.yaml>``, the shortcut plan documents, names the profile of the tune's plans too."""
    from moe_lab.tune.__main__ import main

    profile = yaml.safe_load((CONF_DIR / "hardware" / "h200.yaml").read_text()) | {"name": "h200_mine"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(profile))
    directory = tmp_path / "tune"
    monkeypatch.setattr(sys, "argv", ["tune", *NARROW, f"hardware={tmp_path / 'mine.yaml'}", f"tune.dir={directory}"])
    main()
    assert json.loads((directory / TUNE).read_text())["hardware"]["name"] == "h200_mine"


def test_no_winner_where_every_measured_candidate_failed():
    """A planned point in place of candidates that ran out of memory would be the plan the measurement refuted."""
    from moe_lab.tune.report import winner

    df = pd.DataFrame(
        {
            "point": ["a", "b", "c"],
            "rank": [1, 2, 3],
            "measured_status": ["oom", "oom", None],
            "measured_tokens_per_s_per_gpu": [None, None, None],
        }
    )
    assert winner(df) == (None, "none of the 2 candidates measured ran to the end (oom 2)")
    df.loc[1, ["measured_status", "measured_tokens_per_s_per_gpu"]] = ["ok", 10.0]
    assert winner(df)[0]["point"] == "b" and winner(df)[1] == "measured"
    df["measured_status"] = None
    assert winner(df)[0]["point"] == "a" and winner(df)[1] == "planned"  # nothing measured: the plan's best


def test_a_tune_whose_measured_candidates_all_failed_exits_1_naming_no_winner(tmp_path, monkeypatch):
    """Every candidate out of memory (each round's sweep stood in for by one writing oom records): the report says
    there is no winner and how they ended, and the command exits 1, as a sweep with no ok point does."""
    from moe_lab.tune import measure as measuring
    from moe_lab.tune.__main__ import main

    def sweep(command, tune_dir, batch, log_path, bar):
        for candidate in batch:
            record = tune_dir / measuring.run_dir_of(candidate) / "result.json"
            record.parent.mkdir(parents=True)
            record.write_text(json.dumps({"status": "oom", "config": {}}))
        return 1, 0.0

    monkeypatch.setattr(measuring, "_run", sweep)
    fixed = ["dispatcher=torch", "offload=none", "precision=bf16", "parallel.ep=1", "parallel.dp_replicate=1"]
    args = ["model=tiny", "ac=none,full", *fixed, "parallel.reshard_after_forward=true", "tune.device=cpu"]
    monkeypatch.setattr(sys, "argv", ["tune", *args, "tune.measure=1", f"tune.dir={tmp_path}"])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 1
    report_text = (tmp_path / "report.md").read_text()
    assert re.search(r"No winner: none of the \d candidates measured ran to the end \(oom \d\)", report_text)
    assert "python -m moe_lab.train" not in report_text
