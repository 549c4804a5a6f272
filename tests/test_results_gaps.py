"""What the mutation audit of moe_lab.results and moe_lab.metrics found no test asserting: a tune's table of measured
candidates against their plans (``load_tune``), the run's expert-load summary averaged over layers, and a trace's
breakdown over several steps whose kernels run past a step's boundary, and two refusals and a blank of the docs'
tables (``moe_lab.report``)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from moe_lab import report
from moe_lab.metrics.routing import ExpertLoad
from moe_lab.metrics.trace import CATEGORIES, breakdown
from moe_lab.results import load_tune
from moe_lab.results.tune import PLANS, TUNE


def _measured(run_dir, metrics: dict, emulated: bool = False, status: str = "ok") -> None:
    run_dir.mkdir(parents=True)
    record = {"status": status, "error": None, "config": {}, "metrics": metrics}
    if emulated:
        record["emulated"] = {"world": 16, "rank": 0, "mesh": {"ep": 8}}
    (run_dir / "result.json").write_text(json.dumps(record))


def test_a_tune_table_joins_each_candidates_record_to_its_plan(tmp_path):
    """A real run's errors are its step and peak over the plan's; an emulated rank's step is its compute plus the
    planned exposed communication, its compute error against the planned compute, its peak against the plan's peak
    with the workspace outside the allocator. A candidate of a one-round tune is the sweep job its number names; a
    replacement not measured yet has no measured columns."""
    plans = pd.DataFrame(
        {
            "point": ["dispatcher=torch", "dispatcher=fused", "ac=full", "ac=none"],
            "status": ["ok"] * 4,
            "fits": [True, True, True, False],
            "rank": [1, 2, 3, None],
            "planned_s_per_step": [1.6, 1.2, 2.0, 3.0],
            "planned_compute_s": [1.0, 1.0, 1.5, 2.0],
            "planned_tokens_per_s_per_gpu": [100.0, 130.0, 80.0, 50.0],
            "planned_peak_gpu_mem_gib": [24.0, 24.0, 20.0, 90.0],
            "planned_outside_allocator_gib": [6.0, 6.0, 6.0, 6.0],
        }
    )
    plans.to_csv(tmp_path / PLANS, index=False)
    candidates = [
        {"candidate": 1, "point": "dispatcher=torch"},
        {"candidate": 2, "point": "dispatcher=fused"},
        {"candidate": 3, "point": "ac=full", "replaces": 1, "run_dir": "measured_2/0"},
    ]
    (tmp_path / TUNE).write_text(json.dumps({"candidates": candidates}))
    _measured(tmp_path / "measured" / "0", {"s_per_step": 2.0, "tokens_per_s_per_gpu": 80.0, "peak_gpu_mem_gib": 30.0})
    emulated = {
        "s_per_step": 0.9,
        "s_per_step_measured": 0.9,
        "s_per_step_emulated_total": 1.5,
        "tokens_per_s_per_gpu": 150.0,
        "tokens_per_s_per_gpu_emulated_total": 90.0,
        "peak_gpu_mem_gib": 33.0,
    }
    _measured(tmp_path / "measured" / "1", emulated, emulated=True)

    df = load_tune(tmp_path).set_index("point")
    torch_ = df.loc["dispatcher=torch"]
    assert (torch_["candidate"], torch_["measured_status"], torch_["emulated"]) == (1, "ok", False)
    assert torch_["run_dir"] == str(tmp_path / "measured" / "0")
    assert (torch_["measured_s_per_step"], torch_["measured_tokens_per_s_per_gpu"]) == (2.0, 80.0)
    assert torch_["step_error"] == pytest.approx(2.0 / 1.6 - 1)  # measured over planned, less one
    assert torch_["compute_error"] == pytest.approx(2.0 / 1.6 - 1)  # a real run's compute is its step
    assert torch_["memory_error"] == pytest.approx(30.0 / 24.0 - 1)

    fused = df.loc["dispatcher=fused"]
    assert (fused["candidate"], fused["emulated"], fused["run_dir"]) == (2, True, str(tmp_path / "measured" / "1"))
    assert (fused["measured_s_per_step"], fused["measured_tokens_per_s_per_gpu"]) == (1.5, 90.0)
    assert fused["measured_compute_s"] == 0.9 and fused["compute_error"] == pytest.approx(0.9 / 1.0 - 1)
    assert fused["step_error"] == pytest.approx(1.5 / 1.2 - 1)
    assert fused["memory_error"] == pytest.approx(33.0 / (24.0 + 6.0) - 1)

    replacement = df.loc["ac=full"]
    assert (replacement["candidate"], replacement["replaces"]) == (3, 1) and pd.isna(replacement["measured_status"])
    assert pd.isna(df.loc["ac=none", "candidate"]) and pd.isna(df.loc["dispatcher=torch", "replaces"])


def test_the_runs_expert_load_is_the_mean_over_layers():
    """Two layers of 2 experts on 2 EP ranks, top-1: layer 0 balanced, layer 1 all on expert 0."""
    counts = torch.tensor([[4.0, 4.0], [8.0, 0.0]])
    entropy = torch.tensor([[8 * 0.6], [8 * 0.2]])  # summed over the 8 tokens: 0.6 and 0.2 nats a token
    load = ExpertLoad(top_k=1, ep=2, every=0, steps=1)
    load.add(0, torch.cat([counts, torch.zeros(2, 2), entropy], dim=1), 0.0)
    summary = load.summary()
    assert summary["expert_load"]["max_over_mean"] == [1.0, 2.0]
    assert summary["expert_load_max_over_mean"] == pytest.approx(1.5)
    assert summary["busiest_ep_rank_share"] == pytest.approx((0.5 + 1.0) / 2)
    assert summary["router_entropy"] == pytest.approx((0.6 + 0.2) / 2)


def _x(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def test_a_kernel_running_past_a_step_boundary_counts_in_each_step_for_its_time_there():
    """Two 100 us steps on CUDA: a GEMM launched late in step 1 runs 10 us into it and 30 us into step 2 (the GPU
    lags the host); the compute stream is the one with the most kernel time, not a side stream's short kernel. The
    parts of each step sum to it, and the breakdown is their mean."""
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("ProfilerStep#2", 100, 100, cat="user_annotation"),
        _x("aten::mm", 85, 3),
        _x("cudaLaunchKernel", 86, 1, cat="cuda_runtime", correlation=1),
        _x("aten::_grouped_mm", 135, 3),
        _x("cudaLaunchKernel", 136, 1, cat="cuda_runtime", correlation=2),
        _x("nvjet_tst_128x256", 90, 40, cat="kernel", tid=7, stream=7, correlation=1),
        _x("void cutlass_kernel", 140, 20, cat="kernel", tid=7, stream=7, correlation=2),
        _x("void at::native::vectorized_elementwise_kernel", 150, 5, cat="kernel", tid=8, stream=8),
    ]
    b = breakdown(events)
    assert (b["steps"], b["step_s"]) == (2, pytest.approx(100e-6))
    want = {"dense_gemm": (10 + 30) / 2, "expert_gemm": 20 / 2, "idle": (90 + 50) / 2}
    assert b["seconds"] == pytest.approx({c: want.get(c, 0) * 1e-6 for c in CATEGORIES})


def _grid_sweep(directory, points) -> str:
    """A moe_lab grid sweep's records: (dispatcher, ac, status, tokens/s/GPU) per point, offload none."""
    for n, (dispatcher, ac, status, tps) in enumerate(points):
        (directory / str(n)).mkdir(parents=True)
        record = {
            "status": status,
            "choices": {"dispatcher": dispatcher, "ac": ac, "offload": "none"},
            "overrides": [f"dispatcher={dispatcher}", f"ac={ac}"],
            "config": {},
            "metrics": {"s_per_step": 1.0, "tokens_per_s_per_gpu": tps} if tps else {"peak_gpu_mem_gib": 141},
        }
        (directory / str(n) / "result.json").write_text(json.dumps(record))
    return str(directory)


def test_a_grid_points_ratio_to_torchtitan_is_blank_where_it_did_not_run(tmp_path):
    ours = _grid_sweep(tmp_path / "ours", [("torch", "full", "ok", 50_000.0), ("fused", "full", "oom", None)])
    titan = tmp_path / "titan.json"
    point = {"gpus": 1, "seq_len": 4096, "command": "torchrun"}
    rows = [
        point | {"ac": "full", "status": "ok", "tokens_per_s_per_gpu": 40_000},
        point | {"ac": "none", "status": "oom", "tokens_per_s_per_gpu": None},
    ]
    titan.write_text(json.dumps({"points": rows}))
    table = report.grid(ours, str(titan)).splitlines()
    assert table[0].endswith("| vs torchtitan's fastest (full) |")
    assert table[2].startswith("| none | torch | full | ok |") and table[2].endswith("| 1.25x |")
    assert table[3].startswith("| none | fused | full | oom |") and table[3].endswith("|  |")


def test_best_vs_best_refuses_a_sweep_without_its_torchtitan_file(tmp_path):
    ours = _grid_sweep(tmp_path / "ours", [("torch", "full", "ok", 50_000.0)])
    with pytest.raises(ValueError, match="best-vs-best takes pairs"):
        report.best_vs_best(ours)


def test_an_older_torchtitan_files_selective_point_is_op_level_or_refused(tmp_path):
    """Files from before all four settings ran call op-level selective AC "selective"; a "selective" point of
    another level is refused, not shown under op-selective."""
    titan = tmp_path / "titan.json"
    op = {"ac": "selective", "status": "ok", "command": "torchrun --activation_checkpoint.selective_ac_option op"}
    titan.write_text(json.dumps({"points": [op, {"ac": "full", "status": "ok", "command": "torchrun"}]}))
    assert list(report.torchtitan_points(str(titan))) == ["op-selective", "full"]
    layer = {"ac": "selective", "status": "ok", "command": "torchrun --activation_checkpoint.selective_ac_option 2"}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"points": [layer]}))
    with pytest.raises(ValueError, match="a torchtitan point named 'selective' that is not op-level"):
        report.torchtitan_points(str(other))


def test_what_a_sweep_ran_is_told_only_of_a_whole_grid(tmp_path):
    """ "moe_lab ran: dispatcher torch, fused; ac full, selective" says every combination ran: a sweep missing one
    is refused rather than described so."""
    grid = _grid_sweep(
        tmp_path / "grid", [(d, ac, "ok", 1.0) for d in ("torch", "fused") for ac in ("full", "selective")]
    )
    assert report.grid_covered(report.sweep(grid)).startswith(
        "dispatcher torch, fused; ac full, selective; offload none"
    )
    partial = _grid_sweep(tmp_path / "partial", [("torch", "full", "ok", 1.0), ("fused", "selective", "ok", 1.0)])
    with pytest.raises(ValueError, match="not a grid of dispatcher, ac, offload"):
        report.grid_covered(report.sweep(partial))


def test_check_fails_naming_a_doc_whose_table_its_records_no_longer_give(tmp_path, monkeypatch, capsys):
    record = f"{tmp_path.name}.json"  # report.raw caches by path
    (tmp_path / record).write_text(json.dumps({"status": "ok", "metrics": {"s_per_step": 0.5}}))
    doc = tmp_path / "doc.md"
    stale = f"Prose.\n<!-- table: points {record} -->\n| an old table |\n<!-- /table -->\n"
    doc.write_text(stale)
    monkeypatch.setattr(report, "ROOT", tmp_path)
    monkeypatch.setattr(report, "DOCS", [doc])
    with pytest.raises(SystemExit, match="out of date with their records: doc.md"):
        report.main(["--check"])
    assert doc.read_text() == stale  # checked, not rewritten
    report.main([])
    assert "| `" + record + "` | ok | 0.500 |" in doc.read_text()
    report.main(["--check"])
    assert "1 docs' generated tables: all match their records" in capsys.readouterr().out
