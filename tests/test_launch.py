"""Issue 3, acceptance 3 and the launching rules: a sweep of 2-rank jobs, each starting its own ranks; an outer
torchrun whose other ranks leave no Hydra files; SLURM task variables mapped onto torch.distributed's; and the
``hydra/launcher=slurm`` option composing into the sbatch job it would submit (SLURM itself is not here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from moe_lab import config
from moe_lab.job import launcher
from moe_lab.results.table import load
from tests.cli import train_cli
from tests.configs import compose_train

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["trainer.steps=2", "trainer.warmup_steps=1", "data.seq_len=16", "data.batch_size=1", "trainer.device=cpu"]


@pytest.mark.slow
def test_sweep_of_two_rank_jobs(tmp_path):
    """``-m trainer.nproc_per_node=2 ac=full,selective``: both points run as 2-rank jobs, one result.json each."""
    sweep = tmp_path / "sweep"
    args = ["-m", "trainer.nproc_per_node=2", "ac=full,selective", *SMALL, f"hydra.sweep.dir={sweep}"]
    proc = train_cli(*args, cwd=ROOT, timeout=600)  # forked: tests/cli.py
    assert proc.returncode == 0, proc.stderr[-5000:]
    table = load(sweep)
    assert sorted(table["ac"]) == ["full", "selective"]
    assert (table["status"] == "ok").all() and (table["env.world_size"] == 2).all()
    for run_dir in table["run_dir"]:
        assert sorted(p.name for p in Path(run_dir).iterdir()) == [
            ".hydra",
            "metrics.jsonl",
            "result.json",
            "train.log",
        ]


@pytest.mark.parametrize("mode", ["run", "multirun"])
@pytest.mark.slow
def test_outer_torchrun_only_rank0_leaves_files(mode, tmp_path):
    """Under ``torchrun`` each rank runs the Hydra app; only rank 0's run directory appears, with one record."""
    sweep = ["-m"] if mode == "multirun" else []
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "-m",
        "moe_lab.train",
        *sweep,
        "parallel.ep=2",
        *SMALL,
    ]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    run_dirs = [p.parent for p in tmp_path.rglob("result.json")]
    top = {"run": "outputs", "multirun": "multirun"}[mode]
    assert len(run_dirs) == 1 and sorted(p.name for p in tmp_path.iterdir()) == [top]
    assert len(list((tmp_path / top).glob("*/*"))) == 1  # no directory of another rank
    expected = [".hydra", "metrics.jsonl", "result.json", "train.log"] + ([".moe_lab.lock"] if mode == "run" else [])
    assert sorted(p.name for p in run_dirs[0].iterdir()) == sorted(expected)  # a single run locks its directory
    if mode == "multirun":  # the sweep's own record, once
        assert sorted(p.name for p in run_dirs[0].parent.iterdir()) == [".moe_lab.lock", "0", "multirun.yaml"]
    result = json.loads((run_dirs[0] / "result.json").read_text())
    assert result["status"] == "ok" and result["world_size"] == 2


def test_slurm_task_becomes_a_rank(monkeypatch):
    monkeypatch.setattr(
        os,
        "environ",
        {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
    )
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "16",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
    }
    os.environ.update(slurm)  # a private copy: what the launcher sets here does not leak into later tests
    assert launcher.started_by_outer_launcher()
    launcher.adopt_slurm_environment()
    env = os.environ
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("9", "16", "1", "8")
    assert env["MASTER_ADDR"] == "gpu07" and 20000 <= int(env["MASTER_PORT"]) < 60000
    assert launcher.rank_hydra_overrides()[:3] == [
        "hydra.output_subdir=null",
        "hydra/job_logging=disabled",
        "hydra/hydra_logging=disabled",
    ]


@pytest.fixture
def slurm_cfg():
    GlobalHydra.instance().clear()
    overrides = [
        "hydra/launcher=slurm",
        "hydra.launcher.nodes=2",
        "hydra.launcher.partition=h200",
        "hydra.launcher.timeout_min=90",
        "model=qwen3_30b",
        "parallel.ep=8",
    ]
    yield compose_train(*overrides, return_hydra_config=True)
    GlobalHydra.instance().clear()


def test_slurm_launcher_submits_one_task_per_gpu(slurm_cfg, tmp_path, monkeypatch):
    """The composed launcher builds a submitit SLURM executor; its sbatch script asks for 2 nodes x 8 GPUs with one
    srun task per GPU. The submission itself (``map_array``) is intercepted."""
    import submitit

    fake_bin = tmp_path / "bin"  # submitit looks for srun on PATH before it builds a SLURM executor; never run
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    slurm_cfg.hydra.sweep.dir = str(tmp_path / "sweep")
    hydra_launcher = instantiate(slurm_cfg.hydra.launcher)
    hydra_launcher.setup(hydra_context=None, task_function=None, config=slurm_cfg)
    submitted = {}

    def map_array(executor, fn, *args):
        submitted.update(executor=executor, fn=fn, args=args)
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", map_array)
    hydra_launcher.launch([["ac=full"], ["ac=selective"]], initial_job_idx=0)

    assert submitted["fn"] is hydra_launcher and list(submitted["args"][0]) == [["ac=full"], ["ac=selective"]]
    slurm = submitted["executor"]._executor
    assert isinstance(slurm, submitit.SlurmExecutor)
    sbatch = slurm._make_submission_file_text("python -u -m submitit.core._submit", "uid")
    for line in (
        "--nodes=2",
        "--ntasks-per-node=8",
        "--gpus-per-node=8",
        "--cpus-per-task=16",
        "--partition=h200",
        "--time=90",
    ):
        assert f"#SBATCH {line}\n" in sbatch, line
    assert "srun " in sbatch
    # Every task is a rank of one job: the world the config is validated against is nodes x GPUs.
    monkeypatch.setenv("WORLD_SIZE", "16")
    config.validate(slurm_cfg)


def _process_failure(tmp_path, rank: int, exitcode: int, exception: str | None = None, timestamp: int = 100):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error_rank{rank}.json"
    if exception:  # as torch elastic's error handler writes it for a rank that raised
        info = {"py_callstack": f"Traceback of rank {rank}", "timestamp": str(timestamp)}
        error_file.write_text(json.dumps({"message": {"message": exception, "extraInfo": info}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_a_failed_rank_is_named_before_what_rank0_saw(tmp_path):
    """The record's story of elastic's ChildFailedError: the rank that died, how (signal or exit code, its own
    exception), then rank 0's symptom; a rank 0 that failed itself is named as any rank is."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    symptom = {"type": "RuntimeError", "message": "Connection closed by peer", "traceback": "rank 0's traceback"}
    killed = launcher.RanksFailed(ChildFailedError("worker", {1: _process_failure(tmp_path, 1, -9)}), symptom)
    assert str(killed).startswith("rank 1 (pid 1001) died of signal SIGKILL")
    assert str(killed).endswith("; rank 0 then failed: RuntimeError: Connection closed by peer")
    assert (killed.details["rank"], killed.details["signal"], killed.details["exit_code"]) == (1, "SIGKILL", None)
    assert killed.details["rank0_error"] == {"type": "RuntimeError", "message": "Connection closed by peer"}
    assert killed.traceback == "rank 0's traceback"  # a signal leaves none of its own

    failures = {
        0: _process_failure(tmp_path, 0, 1, "RuntimeError: gloo timeout", timestamp=101),
        1: _process_failure(tmp_path, 1, 3, "ValueError: bad shard", timestamp=100),
    }
    raised = launcher.RanksFailed(ChildFailedError("worker", failures), symptom)
    assert str(raised) == (
        "rank 1 (pid 1001) exited with code 3: ValueError: bad shard; "
        "rank 0 (pid 1000) exited with code 1: RuntimeError: gloo timeout"
    )
    assert raised.details["exit_code"] == 3 and raised.details["rank0_error"] is None
    assert raised.traceback == "Traceback of rank 1"


@pytest.mark.slow
@pytest.mark.parametrize("dead", [1, 0])
def test_the_record_of_a_job_whose_rank_was_killed_names_that_rank(dead, tmp_path):
    """A rank of a two-rank job killed with SIGKILL mid-run: the job ends at once, and its record names the dead
    rank and its signal first (rank 0's symptom, when rank 0 survived it, second)."""
    from tests.test_resume import BASE, Job, mesh, paused

    run_dir, pause_dir = tmp_path / "run", tmp_path / "pause"
    job = Job([*BASE, *mesh("none", 2, 2), f"hydra.run.dir={run_dir}"], tmp_path, pause=f"2:{pause_dir}")
    job.wait_for(lambda: paused(pause_dir, 2)() and all((pause_dir / f"paused_rank{r}").read_text() for r in range(2)))
    os.kill(int((pause_dir / f"paused_rank{dead}").read_text()), signal.SIGKILL)
    (pause_dir / "release").touch()  # the survivor goes on into a collective with the dead rank
    assert job.wait() != 0
    record = json.loads((run_dir / "result.json").read_text())
    error = record["error"]
    assert record["status"] == "error" and error["type"] == "RanksFailed"
    assert error["message"].startswith(f"rank {dead} (pid ") and "died of signal SIGKILL" in error["message"]
    assert (error["rank"], error["signal"]) == (dead, "SIGKILL") and "<NONE>" not in error["message"]
    if dead == 1:
        assert "; rank 0 then failed: " in error["message"] and error["rank0_error"]["type"]
    assert record["world_size"] == 2 and record["config"]["trainer"]["nproc_per_node"] == 2


@pytest.mark.slow
def test_the_ranks_end_with_a_job_killed_outright(tmp_path):
    """The job's own process killed with SIGKILL (the OOM killer, a kill -9 of the pid the user saw), its process
    group left alone: its ranks end too, not training on unlocked into a run directory that the same command run
    again would share with them."""
    from tests.test_resume import BASE, Job, mesh, paused

    run_dir, pause_dir = tmp_path / "run", tmp_path / "pause"
    job = Job([*BASE, *mesh("none", 2, 2), f"hydra.run.dir={run_dir}"], tmp_path, pause=f"2:{pause_dir}")
    job.wait_for(lambda: paused(pause_dir, 2)() and all((pause_dir / f"paused_rank{r}").read_text() for r in range(2)))
    ranks = [psutil.Process(int((pause_dir / f"paused_rank{r}").read_text())) for r in range(2)]
    try:
        job.proc.send_signal(signal.SIGKILL)
        job.proc.wait()
        _, running = psutil.wait_procs(ranks, timeout=10)  # (a rank not yet reaped by its parent counts as ended)
        assert not [p for p in running if p.status() != psutil.STATUS_ZOMBIE], "ranks still running after the job"
    finally:
        (pause_dir / "release").touch()
        try:
            os.killpg(job.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
