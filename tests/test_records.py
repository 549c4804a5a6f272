"""Records of a real CPU sweep (tests/sweep.py: 12 points, 6 invalid, one injected OOM, one injected crash), resume,
the sweep table, and the experiment presets."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
import torch

from moe_lab import config as config_lib
from moe_lab.config.validate import job_target
from moe_lab.job.lifecycle import RunDirInUse, clear_earlier, earlier_record, point_config
from moe_lab.results import load
from moe_lab.results.record import METRICS, RESULT, MetricsLog, write_json_atomic
from tests.configs import compose_train
from tests.sweep import EXPECTED, ROOT, ensure_sweep, run_sweep


@pytest.fixture(scope="module")
def sweep_dir(shared_tmp_path) -> Path:
    return ensure_sweep(shared_tmp_path)


def _key(row) -> tuple:
    return (row["ac"], row["optimizer"], str(row["parallel.ep"]))


@pytest.mark.slow
def test_every_point_has_one_record_with_its_status(sweep_dir):
    points = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(points) == len(EXPECTED) == 12
    for point in points:
        assert [f.name for f in point.iterdir() if f.name.startswith((RESULT, f".{RESULT}"))] == [RESULT]
    df = load(sweep_dir)
    assert {_key(row): row["status"] for _, row in df.iterrows()} == EXPECTED
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    for point in points:
        record = json.loads((point / RESULT).read_text())
        assert record["choices"]["ac"] == record["overrides"][0].split("=")[1]
        if record["status"] == "invalid":
            assert record["error"]["key"] == "parallel.ep" and "must" in record["error"]["message"]
            continue
        env = record["environment"]
        assert env["torch"] == torch.__version__ and env["host"] and env["gpu_count"] == 0 and env["gpu"] is None
        if git.returncode == 0:  # the commit the sweep ran from: HEAD then, HEAD or an ancestor now
            ancestor = ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", env["git_commit"], "HEAD"]
            assert len(env["git_commit"]) == 40 and subprocess.run(ancestor).returncode == 0
        else:
            assert env["git_commit"] is None
        if record["status"] in ("oom", "error"):  # a failure's peak memory, GPU (null on CPU) and host
            assert record["metrics"]["peak_gpu_mem_gib"] is None and record["metrics"]["peak_host_rss_gib"] > 0
        if record["status"] == "oom":
            assert record["error"]["type"] == "OutOfMemoryError"
        elif record["status"] == "error":
            assert record["error"]["type"] == "RuntimeError" and "injected" in record["error"]["message"]
        else:
            m = record["metrics"]
            assert len(m["losses"]) == m["steps"] == 4 and all(map(torch.isfinite, torch.tensor(m["losses"])))
            assert m["s_per_step"] > 0 and m["tokens_per_s_per_gpu"] > 0 and m["trace_breakdown"]["steps"] == 1
            assert len((point / "metrics.jsonl").read_text().splitlines()) == 4


def test_table_columns_and_parquet(sweep_dir, tmp_path):
    df = load(str(sweep_dir / "*"))  # a glob of point directories works as well as the sweep directory
    assert len(df) == 12 and df["parallel.ep"].dtype.kind == "i"
    assert {"dispatcher", "ac", "offload", "model", "status", "error_type", "s_per_step", "time.dense_gemm"} <= set(
        df.columns
    )
    assert not any(df[c].map(lambda v: isinstance(v, (list, dict))).any() for c in df.columns)
    ok = df[df.status == "ok"]
    assert ok["s_per_step"].notna().all() and df[df.status != "ok"]["s_per_step"].isna().all()
    df.to_parquet(tmp_path / "sweep.parquet")
    back = pd.read_parquet(tmp_path / "sweep.parquet")
    assert list(back.columns) == list(df.columns) and back["status"].tolist() == df["status"].tolist()
    pd.testing.assert_series_equal(back["s_per_step"], df["s_per_step"])


def test_rerun_skips_done_points_and_completes_the_rest(sweep_dir, tmp_path):
    resumed = tmp_path / "sweep"
    shutil.copytree(sweep_dir, resumed)
    before = {p.parent.name: (p.stat().st_mtime_ns, p.read_text()) for p in resumed.glob(f"*/{RESULT}")}
    proc = run_sweep(resumed, inject=[])  # the failures were transient: this time every valid point trains
    assert proc.returncode == 0, proc.stderr[-3000:]
    df = load(resumed)
    statuses = {_key(row): row["status"] for _, row in df.iterrows()}
    assert statuses == {k: "invalid" if v == "invalid" else "ok" for k, v in EXPECTED.items()}
    for _, row in df.iterrows():
        name = Path(row["run_dir"]).name
        unchanged = (Path(row["run_dir"]) / RESULT).stat().st_mtime_ns == before[name][0]
        assert unchanged == (EXPECTED[_key(row)] == "ok"), name
    assert proc.stdout.count("point already done, skipped") == 4


def test_only_an_ok_record_of_the_same_configuration_is_skipped(tmp_path):
    cfg = compose_train("ac=full")
    other = compose_train("ac=full", "data.seq_len=32")
    resumed = compose_train("ac=full", "trainer.skip_done=false")
    assert earlier_record(tmp_path, cfg, multirun=True) is None
    write_json_atomic(tmp_path / RESULT, {"status": "ok", "config": point_config(cfg)})
    assert earlier_record(tmp_path, cfg, multirun=True)["status"] == "ok"
    with pytest.raises(RunDirInUse):
        earlier_record(tmp_path, other, multirun=True)
    assert (tmp_path / RESULT).exists()
    # a deliberate re-run of the same point, or its failed attempt: run again, the record replaced once the config
    # is valid (clear_earlier), not before (an invalid one keeps it)
    assert earlier_record(tmp_path, resumed, multirun=True) is None and (tmp_path / RESULT).exists()
    clear_earlier(tmp_path)
    assert not (tmp_path / RESULT).exists()
    write_json_atomic(tmp_path / RESULT, {"status": "oom", "config": point_config(cfg)})
    assert earlier_record(tmp_path, cfg, multirun=True) is None and (tmp_path / RESULT).exists()


def test_atomic_write_leaves_a_readable_record_and_no_temp_file_on_failure(tmp_path):
    write_json_atomic(tmp_path / RESULT, {"status": "ok"})
    assert (tmp_path / RESULT).stat().st_mode & 0o044 == 0o044  # group and others may read it (umask allowing)
    with pytest.raises(TypeError):
        _write_unserialisable(tmp_path / RESULT)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RESULT]
    assert json.loads((tmp_path / RESULT).read_text()) == {"status": "ok"}


def _write_unserialisable(path):
    class Unprintable:
        def __str__(self):
            raise TypeError("cannot serialise")

    write_json_atomic(path, {"bad": Unprintable()})


PRESETS = {
    "grid_30b": dict(
        model="qwen3_30b",
        world=1,
        ep=1,
        seq=16384,
        sweep={"dispatcher": "torch,fused", "ac": "full,selective", "offload": "none,optimizer,full"},
    ),
    "reference_235b": dict(model="qwen3_235b", world=32, ep=8, seq=16384, sweep=None),
    "reference_30b": dict(model="qwen3_30b", world=8, ep=8, seq=16384, sweep=None),
    "routing_skew": dict(
        model="qwen3_30b", world=2, ep=2, seq=16384, sweep={"model.routing_skew": "0.25,0.5,1.0,1.5,2.0"}
    ),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_experiment_preset_composes_and_validates(name, monkeypatch):
    want = PRESETS[name]
    if want["world"] > 8:  # more ranks than one node: the outer launcher (srun) sets WORLD_SIZE
        monkeypatch.setenv("WORLD_SIZE", str(want["world"]))
    cfg = compose_train(f"+experiment={name}", return_hydra_config=True)
    assert cfg.model.name == want["model"] and cfg.data.seq_len == want["seq"] and cfg.data.batch_size == 1
    assert cfg.parallel.ep == want["ep"] and job_target(cfg).world_size == want["world"]
    for key, values in (want["sweep"] or {}).items():
        assert cfg.hydra.sweeper.params[key] == values
    config_lib.validate(cfg)
    # Every point of the preset's sweep is a valid configuration.
    axes = [[f"{key}={v}" for v in values.split(",")] for key, values in (want["sweep"] or {}).items()]
    for point in itertools.product(*axes):
        config_lib.validate(compose_train(f"+experiment={name}", *point))


def test_point_labels_name_only_the_keys_a_point_sets():
    """Two points overriding different keys: each is named by its own key, not by the other's missing value."""
    from moe_lab.results.table import point_labels

    df = pd.DataFrame(
        {
            "error_message": [None, None],
            "dispatcher.save": ["inputs", float("nan")],
            "ac.keep": [float("nan"), "[attention]"],
            "overrides": [[], []],
            "run_dir": ["runs/0", "runs/1"],
        }
    )
    assert list(point_labels(df)) == ["dispatcher.save=inputs", "ac.keep=[attention]"]
    assert list(point_labels(df.assign(**{"ac.keep": float("nan")}))) == ["dispatcher.save=inputs", "runs/1"]


def test_a_resumed_metrics_log_keeps_the_rows_before_its_first_step_and_their_times(tmp_path):
    """A run resumed at step 3 keeps rows 0-2 (their step times time the whole run) and drops what an interrupted
    attempt wrote at step 3 and after, and a line cut short; a run from step 0 starts the file afresh."""
    times = [0.5, 0.25, 0.125, 4.0, 8.0]
    text = "".join(json.dumps({"step": s, "loss": 1.0, "s_per_step": t}) + "\n" for s, t in enumerate(times))
    (tmp_path / METRICS).write_text(text + '{"step": 5, "lo')
    log = MetricsLog(tmp_path, first_step=3)
    assert log.kept_step_times == [0.5, 0.25, 0.125]
    log.write({"step": 3, "loss": 0.5, "s_per_step": 1.0})
    log.close()
    assert [json.loads(line)["step"] for line in (tmp_path / METRICS).read_text().splitlines()] == [0, 1, 2, 3]
    MetricsLog(tmp_path).close()
    assert (tmp_path / METRICS).read_text() == ""
