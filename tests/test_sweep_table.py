"""moe_lab.results on a synthetic set of records: every swept key is an axis of the notebook's "s/step by axis"
table (a ``parallel.ep=1,2`` sweep once showed the median of EP 1 and EP 2 under one dispatcher x ac cell), also a
key only later points override, and the preset a point came from is a column."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from moe_lab.results import load
from moe_lab.results.table import by_axes, layer_load, step_rows, varying_axes


def write_point(sweep: Path, n: int, dispatcher: str, ep: int, s_per_step: float, extra: tuple[str, ...] = ()) -> None:
    point = sweep / str(n)
    point.mkdir(parents=True)
    record = {
        "choices": {"experiment": "grid_30b/two_gpu", "dispatcher": dispatcher, "ac": "full", "model": "tiny"},
        "overrides": [f"dispatcher={dispatcher}", f"parallel.ep={ep}", "+experiment=grid_30b/two_gpu", *extra],
        "config": {"parallel": {"ep": ep, "dp_shard": -1}, "trainer": {"seed": 1}},
        "environment": {"git_commit": "0" * 40},
        "status": "ok",
        "error": None,
        "metrics": {"s_per_step": s_per_step, "mfu": 0.5 / s_per_step},
    }
    (point / "result.json").write_text(json.dumps(record))


@pytest.fixture
def sweep(tmp_path) -> Path:
    # dispatcher x parallel.ep, EP 2 twice as slow as EP 1; the last two points also override trainer.seed (a key
    # the first points lack)
    times = {("torch", 1): 1.0, ("torch", 2): 2.0, ("fused", 1): 0.5, ("fused", 2): 1.5}
    for n, ((dispatcher, ep), s) in enumerate(times.items()):
        write_point(tmp_path, n, dispatcher, ep, s, extra=("trainer.seed=1",) if n >= 2 else ())
    return tmp_path


def test_the_preset_is_a_column(sweep):
    assert set(load(sweep)["experiment"]) == {"grid_30b/two_gpu"}


def test_every_swept_key_is_an_axis_also_one_only_later_points_override(sweep):
    df = load(sweep)
    assert varying_axes(df) == ["dispatcher", "parallel.ep", "trainer.seed"]
    assert list(df.columns).index("trainer.seed") < list(df.columns).index("overrides")


def test_by_axes_takes_no_median_across_a_swept_key(sweep):
    df = load(sweep).drop(columns="trainer.seed")  # dispatcher x parallel.ep only
    table = by_axes(df, ["s_per_step"])["s_per_step"]
    expected = pd.DataFrame({"1": [0.5, 1.0], "2": [1.5, 2.0]}, index=pd.Index(["fused", "torch"], name="dispatcher"))
    pd.testing.assert_frame_equal(table, expected, check_names=False)


def test_by_axes_takes_the_median_of_repeats_of_one_point(sweep):
    write_point(sweep, 4, "torch", 1, 3.0)  # torch/EP 1 again (a re-run), 1.0 and 3.0: median 2.0
    table = by_axes(load(sweep).drop(columns="trainer.seed"), ["s_per_step"])["s_per_step"]
    assert table.loc["torch", "1"] == 2.0 and table.loc["torch", "2"] == 2.0


def test_by_axes_of_a_single_point():
    df = pd.DataFrame(
        {
            "run_dir": ["a"],
            "status": ["ok"],
            "error_type": [None],
            "error_message": [None],
            "ac": ["full"],
            "overrides": ["ac=full"],
            "s_per_step": [0.25],
        }
    )
    assert by_axes(df, ["s_per_step"]).to_dict("records") == [{"s_per_step": 0.25}]


def test_step_rows_and_layer_load_read_each_points_files(sweep):
    """Train/eval loss and imbalance by step from metrics.jsonl, the run's load per layer from result.json."""
    point = sweep / "1"
    rows = [
        {"step": 0, "loss": 5.0, "expert_load": {"max_over_mean": [1.0, 3.0], "busiest_ep_rank_share": [0.5, 0.7]}},
        {"step": 1, "loss": 4.0, "eval_loss": 4.5},
    ]
    (point / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = json.loads((point / "result.json").read_text())
    record["metrics"]["expert_load"] = {
        "max_over_mean": [1.5, 2.5],
        "busiest_ep_rank_share": [0.6, 0.8],
        "entropy": [1.0, 0.9],
    }
    (point / "result.json").write_text(json.dumps(record))
    df = load(sweep)
    steps = step_rows(df)
    assert steps["point"].tolist() == ["dispatcher=torch parallel.ep=2"] * 2  # trainer.seed: another point's key
    assert steps["loss"].tolist() == [5.0, 4.0] and steps["max_over_mean"].tolist()[0] == 2.0
    assert pd.isna(steps["eval_loss"][0]) and steps["eval_loss"][1] == 4.5
    layers = layer_load(df)
    assert layers["layer"].tolist() == [0, 1] and layers["max_over_mean"].tolist() == [1.5, 2.5]


def test_a_glob_of_point_directories_reads_in_job_order(tmp_path):
    """Points 0, 1, ..., 10 in job order, not 0, 1, 10, 2, also when a pattern names them."""
    for n in range(11):
        write_point(tmp_path, n, "torch", 1, 1.0 + n)
    expected = [str(tmp_path / str(n)) for n in range(11)]
    assert load(tmp_path)["run_dir"].tolist() == expected
    assert load(str(tmp_path / "*"))["run_dir"].tolist() == expected
    assert load(str(tmp_path / "*" / "result.json"))["run_dir"].tolist() == expected


def test_an_appended_key_is_an_axis_under_its_own_name_with_its_resolved_value(tmp_path):
    """``+model.routing_skew=0.5`` is the axis ``model.routing_skew``, typed as the config holds it."""
    for n, skew in enumerate((0.5, 1.5)):
        write_point(tmp_path, n, "torch", 1, 1.0, extra=(f"+model.routing_skew={skew}",))
        record = json.loads((tmp_path / str(n) / "result.json").read_text())
        record["config"]["model"] = {"routing_skew": skew}
        (tmp_path / str(n) / "result.json").write_text(json.dumps(record))
    df = load(tmp_path)
    assert "+model.routing_skew" not in df.columns and df["model.routing_skew"].tolist() == [0.5, 1.5]
    assert varying_axes(df) == ["model.routing_skew"]


def test_an_emulated_point_names_its_rank_layout_and_planned_communication(tmp_path):
    """``parallel.emulate``: the ``emulated`` label says which rank of which layout (replicas only where there are
    several), each field is a column (not its note), and the planned exposed communication per category too."""
    for n, replicas in enumerate((1, 2)):
        write_point(tmp_path, n, "torch", 1, 1.0)
        path = tmp_path / str(n) / "result.json"
        record = json.loads(path.read_text())
        mesh = {"nodes": 2, "gpus_per_node": 8, "dp_replicate": replicas, "dp_shard": 16 // replicas, "ep": 8}
        record["emulated"] = {"world": 16, "rank": 0, "mesh": mesh, "hardware": "h200", "note": "one process"}
        record["metrics"]["planned_exposed_comm_by_category_s"] = {"ep_all_to_all": 0.25, "fsdp_all_gather": 0.5}
        path.write_text(json.dumps(record))
    df = load(tmp_path)
    assert df["emulated"].tolist() == ["rank 0 of 16 (2 x 8, ep 8)", "rank 0 of 16 (2 x 8, 2 replicas, ep 8)"]
    assert df["emulated.world"].tolist() == [16, 16] and df["emulated.mesh.dp_shard"].tolist() == [16, 8]
    assert df["emulated.hardware"].tolist() == ["h200", "h200"] and "emulated.note" not in df.columns
    assert df["planned_comm.ep_all_to_all"].tolist() == [0.25, 0.25]
    assert df["planned_comm.fsdp_all_gather"].tolist() == [0.5, 0.5]


def test_the_pareto_front_keeps_the_points_no_other_beats():
    """Lower cost and higher gain: a point another matches in gain at a lower cost is not on the front."""
    from moe_lab.results.table import pareto_front

    df = pd.DataFrame(
        {
            "memory": [40.0, 30.0, 50.0, 35.0, 60.0, 45.0],
            "speed": [100.0, 80.0, 120.0, 80.0, 110.0, float("nan")],
        },
        index=list("abcdef"),
    )
    front = pareto_front(df, "memory", "speed")
    assert front.index.tolist() == ["b", "a", "c"]  # d: b's speed for more memory; e: slower than c for more


def test_a_metrics_line_that_is_no_step_row_is_an_error_naming_file_and_line(tmp_path):
    """Only the last line may be cut short (read as the steps so far, with a warning); a line before it that is no
    row (JSON without a step, not an object) is a ValueError naming the file and the line."""
    from moe_lab.results.table import metric_rows

    path = tmp_path / "metrics.jsonl"
    for bad in ('{"loss": 2.5}', "[1, 2]"):
        path.write_text(f'{{"step": 0, "loss": 3.0}}\n{bad}\n{{"step": 2, "loss": 2.0}}\n')
        with pytest.raises(ValueError, match=f"{path}: line 2 is no metrics row"):
            metric_rows(path)
    path.write_text('{"step": 0, "loss": 3.0}\n{"step": 1, "loss": 2.5}\n{"loss": 2.')
    with pytest.warns(UserWarning, match="its last line is cut short .*: read up to step 1"):
        assert [row["step"] for row in metric_rows(path)] == [0, 1]
