"""The one ``Record`` type every result.json is made with: each outcome's fields, the JSON on disk, and the sweep
table reading every kind back (the shape tests/test_records.py checks on a real sweep)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from moe_lab.config import ConfigError
from moe_lab.results import load
from moe_lab.results.record import RESULT, Record

META = {"choices": {"ac": "full"}, "overrides": ["ac=full"], "sweep": None, "started_utc": "2026-12-01T00:00:00+00:00"}
CFG = OmegaConf.create({"trainer": {"steps": 2}, "ac": {"_target_": "moe_lab.parallel.ac.FullCheckpoint"}})


def point() -> Record:
    return Record.point(META, CFG, world_size=1, environment={"device": "cpu"})


def test_a_point_holds_meta_config_and_its_fields():
    assert point() == {**META, "world_size": 1, "environment": {"device": "cpu"}, "config": OmegaConf.to_container(CFG)}


def test_each_outcome_sets_status_and_error_and_leaves_the_point_as_it_was():
    base = point()
    ok = base.ok({"s_per_step": 0.5})
    assert (ok["status"], ok["error"], ok["metrics"]) == ("ok", None, {"s_per_step": 0.5})
    invalid = Record.point(META, CFG).invalid(ConfigError("parallel.ep", "must divide 8, got 3"))
    assert invalid["status"] == "invalid" and "world_size" not in invalid  # nothing ran: no device, no ranks
    assert invalid["environment"]["torch"] == torch.__version__ and "git_commit" in invalid["environment"]
    assert "device" not in invalid["environment"]
    message = "parallel.ep: must divide 8, got 3"
    assert invalid["error"] == {"type": "ConfigError", "key": "parallel.ep", "message": message}
    unexpected = base.invalid(KeyError("x"))["error"]
    assert (unexpected["type"], unexpected["key"]) == ("KeyError", None)
    assert unexpected["message"].startswith("validation failed")
    oom = base.failure(torch.OutOfMemoryError("CUDA out of memory"), {"peak_gpu_mem_gib": 1.0})
    assert oom["status"] == "oom" and oom["metrics"] == {"peak_gpu_mem_gib": 1.0} and "traceback" in oom["error"]
    crash = base.failure(RuntimeError("boom"))
    assert crash["status"] == "error" and crash["error"]["message"] == "boom" and "metrics" not in crash
    stopped = base.interrupted("SIGTERM", 3, "/ckpt/step_3", {"steps_done": 3})
    assert stopped["status"] == "interrupted" and stopped["metrics"] == {"steps_done": 3}
    assert stopped["error"]["exit_code"] == 143
    assert stopped["error"]["message"] == "SIGTERM received: stopped after step 3; checkpoint /ckpt/step_3"
    before = Record.point(META, CFG).interrupted("SIGINT", None, None)["error"]["message"]
    assert before == "SIGINT received: stopped before training started"
    assert "status" not in base  # every outcome is a new record


def test_a_plan_record_is_kind_plan():
    record = Record.plan(META, CFG, "2026-12-01T00:00:00+00:00").ok({"s_per_step": 1.0}, plan={"fits": True})
    assert record["kind"] == "plan" and record["plan"] == {"fits": True} and record["status"] == "ok"


@pytest.mark.parametrize("outcome", ["ok", "invalid", "oom", "interrupted"])
def test_written_records_load_as_table_rows(outcome, tmp_path):
    base = point()
    record = {
        "ok": lambda: base.ok({"s_per_step": 0.5}),
        "invalid": lambda: base.invalid(ConfigError("parallel.ep", "bad")),
        "oom": lambda: base.failure(torch.OutOfMemoryError("out of memory")),
        "interrupted": lambda: base.interrupted("SIGTERM", 1, None),
    }[outcome]()
    record.write(tmp_path / "0")
    assert json.loads((tmp_path / "0" / RESULT).read_text()) == json.loads(json.dumps(record))
    row = load(tmp_path).iloc[0]
    assert row["status"] == record["status"] and row["ac"] == "full"
    assert (row["s_per_step"] == 0.5) if outcome == "ok" else row["error_type"] == record["error"]["type"]


def test_a_records_choices_are_the_configs_groups_not_hydras():
    """The group choices a record holds (the table's axes, wandb's tags) leave out Hydra's own groups; a single run
    names no sweep, a multirun point its sweep directory."""
    from hydra.types import RunMode

    from moe_lab.results.record import job_meta

    choices = {"model": "tiny", "hydra/launcher": "basic", "hydra/sweeper": "basic", "ac": "full"}
    hc = OmegaConf.create(
        {
            "runtime": {"choices": choices},
            "overrides": {"task": ["ac=full", "trainer.steps=2"]},
            "sweep": {"dir": "multirun/sweep"},
            "mode": RunMode.RUN,
        }
    )
    assert job_meta(hc) == {
        "choices": {"model": "tiny", "ac": "full"},
        "overrides": ["ac=full", "trainer.steps=2"],
        "sweep": None,
    }
    hc.mode = RunMode.MULTIRUN
    assert job_meta(hc)["sweep"] == "multirun/sweep"


def test_a_failure_record_holds_the_fields_and_the_traceback_its_exception_carries(tmp_path):
    """A damaged checkpoint's record names the checkpoint and the file; a failed rank's (RanksFailed) names the rank
    and how it ended, with that rank's traceback in place of the launcher's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from moe_lab.checkpoint.checkpointer import CheckpointDamaged
    from moe_lab.job.launcher import RanksFailed

    damaged = point().failure(CheckpointDamaged(Path("/ckpt/step_2"), "__0_0.distcp", "cut short: 100 bytes"))
    assert (damaged["status"], damaged["error"]["type"]) == ("error", "CheckpointDamaged")
    assert (damaged["error"]["checkpoint"], damaged["error"]["file"]) == ("/ckpt/step_2", "__0_0.distcp")

    error_file = tmp_path / "error_rank1.json"
    info = {"py_callstack": "Traceback of rank 1", "timestamp": "100"}
    error_file.write_text(json.dumps({"message": {"message": "ValueError: bad shard", "extraInfo": info}}))
    failure = ProcessFailure(local_rank=1, pid=1001, exitcode=3, error_file=str(error_file))
    ranks = point().failure(RanksFailed(ChildFailedError("worker", {1: failure})))
    assert ranks["error"]["message"] == "rank 1 (pid 1001) exited with code 3: ValueError: bad shard"
    assert (ranks["error"]["rank"], ranks["error"]["exit_code"], ranks["error"]["signal"]) == (1, 3, None)
    assert ranks["error"]["traceback"] == "Traceback of rank 1"


@pytest.mark.parametrize(
    "message",
    [
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB",
        "[enforce fail at alloc_cpu.cpp:83] DefaultCPUAllocator: not enough memory: you tried to allocate 8 GB",
        "ChildFailedError: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ],
)
def test_each_way_running_out_of_memory_reads_is_an_oom_record(message):
    """Either message of PyTorch's CPU allocator (a plain RuntimeError), and a rank's OOM wrapped by the launcher."""
    assert point().failure(RuntimeError(message))["status"] == "oom"


def test_the_environment_counts_nodes_from_the_ranks_per_node(monkeypatch):
    from moe_lab.results.record import environment

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    env = environment(torch.device("cpu"), 4)
    assert (env["device"], env["world_size"], env["nodes"], env["gpu"], env["gpu_count"]) == ("cpu", 4, 2, None, 0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # a job that starts its ranks itself: one node
    assert environment(torch.device("cpu"), 4)["nodes"] == 1


def test_git_state_is_the_commit_and_whether_tracked_files_changed(tmp_path, monkeypatch):
    """An untracked file (a run's outputs, a notebook) leaves the tree clean; an edited tracked file does not.
    ``MOE_LAB_GIT_COMMIT`` / ``MOE_LAB_GIT_DIRTY`` name them for a tree copied without its history; outside a
    checkout, nulls."""
    from moe_lab.results.record import git_state

    monkeypatch.delenv("MOE_LAB_GIT_COMMIT", raising=False)
    monkeypatch.delenv("MOE_LAB_GIT_DIRTY", raising=False)
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    (repo / "model.py").write_text("x = 1\n")
    for args in (["init", "-q"], ["add", "model.py"], ["commit", "-q", "-m", "first"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (repo / "notes.txt").write_text("untracked\n")
    assert git_state(repo) == {"git_commit": head, "git_dirty": False}
    (repo / "model.py").write_text("x = 2\n")
    assert git_state(repo) == {"git_commit": head, "git_dirty": True}
    assert git_state(tmp_path) == {"git_commit": None, "git_dirty": None}

    monkeypatch.setenv("MOE_LAB_GIT_COMMIT", "f" * 40)
    assert git_state(repo) == {"git_commit": "f" * 40, "git_dirty": None}
    monkeypatch.setenv("MOE_LAB_GIT_DIRTY", "0")
    assert git_state(repo) == {"git_commit": "f" * 40, "git_dirty": False}
