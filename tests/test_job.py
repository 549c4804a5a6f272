"""A job's lifecycle as a user meets it (issue 14): a sweep never lands on another sweep's records, a point's record
is never overwritten by another configuration, --help explains every group and key, and a run says where its files
went, in its log file too."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests import cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["trainer.steps=2", "trainer.warmup_steps=1", "data.seq_len=16", "data.batch_size=1"]


def train_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python -m moe_lab.train ARGS`` in a process of its own (forked from one that imported it: tests/cli.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return cli.train_cli(*args, cwd=cwd, env=env)


def records(sweep: Path) -> dict[str, tuple[str, bytes]]:
    return {
        p.parent.name: (json.loads(p.read_text())["choices"]["ac"], p.read_bytes()) for p in sweep.glob("*/result.json")
    }


def test_another_sweep_never_lands_on_a_sweep_directory(tmp_path):
    sweep = tmp_path / "sweep"
    first = train_cli("-m", "ac=none,full", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before, multirun_yaml = records(sweep), (sweep / "multirun.yaml").read_bytes()
    assert sorted(ac for ac, _ in before.values()) == ["full", "none"]

    other = train_cli("-m", "ac=selective,full", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert other.returncode != 0
    assert f"hydra.sweep.dir={sweep} holds another sweep" in other.stderr + other.stdout
    assert records(sweep) == before and (sweep / "multirun.yaml").read_bytes() == multirun_yaml

    again = train_cli("-m", "ac=none,full", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # the same sweep resumes
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("point already done, skipped") == 2 and records(sweep) == before


def test_a_sweep_that_recorded_no_point_does_not_block_the_corrected_one(tmp_path):
    """A sweep that recorded nothing (refused as Hydra composed it, a dry run) left multirun.yaml and its points'
    .hydra/: another sweep takes the directory over, saying so, and then holds it as its own."""
    sweep = tmp_path / "sweep"
    nothing = train_cli(
        "-m", "dispatcher=torch,fused", *SMALL, "trainer.dry_run=true", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert nothing.returncode == 0 and (sweep / "multirun.yaml").exists() and not list(sweep.rglob("result.json"))
    assert "2 points: 2 dry run (counted, nothing recorded)" in nothing.stdout  # not a sweep that failed

    corrected = train_cli("-m", "dispatcher=torch", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert corrected.returncode == 0, corrected.stderr[-2000:]
    held = f"hydra.sweep.dir={sweep} held another sweep (dispatcher=torch,fused {' '.join(SMALL)} trainer.dry_run=true)"
    assert f"{held} that recorded no point: this sweep takes it over" in corrected.stderr
    assert json.loads((sweep / "0" / "result.json").read_text())["status"] == "ok"

    other = train_cli("-m", "dispatcher=fused", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert other.returncode != 0 and f"hydra.sweep.dir={sweep} holds another sweep" in other.stderr


def test_another_sweep_is_taken_over_only_where_it_left_nothing(tmp_path, monkeypatch, capsys):
    """A point's .hydra/ is nothing of a sweep; a record of any status, or a checkpoint (a point killed before it
    recorded, which the same sweep again continues from), is kept."""
    from omegaconf import OmegaConf

    from moe_lab.job.lifecycle import OutputDirGuard, OutputDirInUse

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)

    def start_sweep(left: str) -> None:
        """Start a sweep (ac=full) into a directory another sweep (ac=none) left ``left`` in."""
        sweep = tmp_path / left.replace("/", "_")
        (sweep / left).parent.mkdir(parents=True)
        (sweep / left).write_text("{}")
        OmegaConf.save({"hydra": {"overrides": {"task": ["ac=none"]}}}, sweep / "multirun.yaml")
        guard = OutputDirGuard()
        try:
            guard.on_multirun_start(
                OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}, "overrides": {"task": ["ac=full"]}}})
            )
        finally:
            guard._release()

    start_sweep("0/.hydra/config.yaml")
    assert "(ac=none) that recorded no point: this sweep takes it over" in capsys.readouterr().err
    for left in ("0/result.json", "0/checkpoints/step_00000001/checkpoint.json"):
        with pytest.raises(OutputDirInUse, match=r"holds another sweep \(ac=none\); this one \(ac=full\)"):
            start_sweep(left)


def test_a_point_record_of_another_configuration_is_never_overwritten(tmp_path):
    """The same overrides over an edited preset are another configuration: the point is not skipped on the strength
    of its overrides, and its directory's record is left alone."""
    sweep = tmp_path / "sweep"
    assert train_cli("-m", "ac=none", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path).returncode == 0
    path = sweep / "0" / "result.json"
    record = json.loads(path.read_text())
    record["config"]["data"]["seq_len"] = 32  # as if the preset had said 32 when the point ran
    path.write_text(json.dumps(record))
    edited = path.read_bytes()
    proc = train_cli("-m", "ac=none", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert "holds the record of another configuration" in proc.stdout + proc.stderr
    assert "point already done" not in proc.stdout and path.read_bytes() == edited

    single = tmp_path / "run"  # a single run into a directory holding another run's record stops, naming it
    assert train_cli(*SMALL, f"hydra.run.dir={single}", cwd=tmp_path).returncode == 0
    proc = train_cli(*SMALL, "ac=full", f"hydra.run.dir={single}", cwd=tmp_path)
    assert proc.returncode != 0 and "holds the record of another configuration" in proc.stderr
    assert json.loads((single / "result.json").read_text())["choices"]["ac"] == "none"


def test_help_explains_every_group_and_key(tmp_path):
    proc = train_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from moe_lab.config.schema import GROUPS, CheckpointConfig, TrainerConfig

    for group, what in GROUPS.items():
        assert f"{group}: {what}" in proc.stdout
    for option in ("tiny", "qwen3_30b", "fused", "selective", "optimizer", "signsgd", "wandb"):
        assert f"    {option} " in proc.stdout, option
    for key in TrainerConfig.__dataclass_fields__:
        assert f"trainer.{key}=" in proc.stdout or f"trainer.{key}.*" in proc.stdout, key
    for key in CheckpointConfig.__dataclass_fields__:  # a nested section's keys under its prefix
        assert f"trainer.checkpoint.{key}=" in proc.stdout, key
    assert "parallel.ep=1" in proc.stdout and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("nproc", [1, 2])
def test_run_says_where_its_files_went_in_its_log(nproc, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        *SMALL,
        f"trainer.nproc_per_node={nproc}",
        "logger=wandb",
        "profile.enabled=true",
        "profile.wait=1",
        "profile.warmup=0",
        "profile.active=1",
        f"hydra.run.dir={run_dir}",
    ]
    proc = train_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    offline = next((run_dir / "wandb").glob("offline-run-*"))
    for line in (
        "done: loss",
        f"run directory: {run_dir}",
        f"trace: {run_dir / 'trace_rank0.json.gz'}",
        f"wandb offline run: {offline}",
        f"upload it with: wandb sync {offline}",
    ):
        assert line in log and line in proc.stdout, line
    # stdout is a pipe here: plain progress lines (the last step's among them), no progress bar's carriage returns
    assert "\r" not in proc.stdout and "train: 2/2 steps, loss " in proc.stdout


def test_a_sweep_directory_in_use_is_refused(tmp_path):
    """Two sweeps into one directory at once would mix their records: the second stops while the first holds the
    directory's lock (held here by this test, as a running sweep holds it)."""
    import fcntl

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    with open(sweep / ".moe_lab.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("a running job (a test's host pid 1)\n")  # a single run into the sweep's directory, say
        lock.flush()
        proc = train_cli("-m", "ac=none", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode != 0
    assert "is in use by a running job (a test's host pid 1)" in proc.stderr  # the holder's kind, not this job's
    assert sorted(p.name for p in sweep.iterdir()) == [".moe_lab.lock"]
    proc = train_cli("-m", "ac=none", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # released: it runs
    assert proc.returncode == 0 and (sweep / "0" / "result.json").exists(), proc.stderr[-3000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_cpu_run_too_large_for_the_host_is_an_oom_record(tmp_path, ranks):
    """The README's 30B proxy on a small CPU machine: refused before the kernel's OOM killer would end it with no
    record (the fp32 weights and gradients alone are 8 bytes per parameter). At 2 ranks the job's process refuses it
    before starting them (each would, after starting, in a page of the launcher's tracebacks)."""
    import psutil

    layers = max(1, int(psutil.virtual_memory().total / (8 * 0.75e9)) + 1)  # > the host's RAM in weights + grads
    run_dir = tmp_path / "run"
    proc = train_cli(
        "model=qwen3_30b",
        f"model.num_layers={layers}",
        "data.seq_len=64",
        "data.batch_size=1",
        "trainer.device=cpu",
        f"trainer.nproc_per_node={ranks}",
        f"parallel.ep={ranks}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert proc.returncode != 0
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "oom" and record["error"]["type"] == "OutOfMemoryError", record["error"]
    assert "host memory" in record["error"]["message"] and record["world_size"] == ranks
    assert "wants a GPU" in record["error"]["message"] and "model=tiny" in proc.stdout  # and how to shrink it
    assert "Traceback" not in proc.stdout + proc.stderr and "Terminating process" not in proc.stdout + proc.stderr
    assert record["metrics"]["peak_gpu_mem_gib"] is None and record["metrics"]["peak_host_rss_gib"] > 0


def test_a_failure_record_holds_the_peak_memory(tmp_path):
    """As an ok record does, GPU (null on CPU) and host: a run that diverged (NaN loss) had its peak too."""
    run_dir = tmp_path / "run"
    args = ["optimizer.lr=1e30", "trainer.steps=4", "trainer.warmup_steps=1", "data.seq_len=16", "data.batch_size=1"]
    proc = train_cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 1
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "error" and record["error"]["type"] == "FloatingPointError", record["error"]
    assert record["metrics"]["peak_gpu_mem_gib"] is None and record["metrics"]["peak_host_rss_gib"] > 0


def test_out_of_memory_reads_as_oom_however_it_arrives():
    import torch

    from moe_lab.results.record import failure

    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 160 GB"
    )
    assert failure(cpu)["status"] == "oom" and failure(MemoryError())["status"] == "oom"
    assert failure(torch.OutOfMemoryError("CUDA out of memory"))["status"] == "oom"
    assert failure(RuntimeError("matrix batch sizes have to match"))["status"] == "error"


def test_an_unreadable_record_is_a_row_naming_its_file(tmp_path):
    from moe_lab.results import load

    for point, text in (
        ("0", json.dumps({"status": "ok", "overrides": ["ac=none"], "choices": {"ac": "none"}})),
        ("1", '{"status": "ok", "overr'),
        ("2", "[1, 2]"),
    ):
        (tmp_path / point).mkdir()
        (tmp_path / point / "result.json").write_text(text)
    with pytest.warns(UserWarning, match="unreadable record"):
        df = load(tmp_path)
    assert df["status"].tolist() == ["ok", "unreadable", "unreadable"]
    assert str(tmp_path / "1" / "result.json") in df["error_message"][1]
    (tmp_path / "empty").mkdir()
    with pytest.warns(UserWarning, match="no result.json under"):  # a sweep not started yet
        assert load(tmp_path / "empty").empty and load(tmp_path / "els*").empty
    with pytest.warns(UserWarning, match="no result.json under"):
        assert load(tmp_path / "empty")["status"].tolist() == []  # read as nothing, not a KeyError
    with pytest.raises(FileNotFoundError, match="no such sweep or run directory: .*elsewhere"):  # a typo
        load(tmp_path / "elsewhere")


def test_a_run_that_trained_without_a_record_is_named_in_a_warning(tmp_path):
    """A point killed outright (or still running) has metrics.jsonl but no result.json: no row, but not silently."""
    from moe_lab.results import load

    for point in ("0", "1", "2"):
        (tmp_path / point).mkdir()
        (tmp_path / point / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "0" / "result.json").write_text(json.dumps({"status": "ok", "overrides": [], "choices": {}}))
    with pytest.warns(UserWarning, match=r"2 run directories under .* trained but hold no result.json") as warned:
        df = load(tmp_path)
    assert df["status"].tolist() == ["ok"]
    assert f"{tmp_path / '1'}, {tmp_path / '2'}" in str(warned[0].message)
    assert "replaced" not in str(warned[0].message)

    (tmp_path / "2" / "result.replaced.json").write_text("{}")  # a re-run killed before recording its own
    with pytest.warns(UserWarning, match="; 1 of them keep the record their re-run replaced as result.replaced.json"):
        assert load(tmp_path)["status"].tolist() == ["ok"]  # the replaced record is no row


@pytest.mark.slow
def test_a_damaged_checkpoint_is_a_record_and_the_sweep_goes_on(tmp_path):
    """Resuming a sweep whose first point left a damaged newest checkpoint (its data file cut short) and no record
    (as a killed point does): with trainer.resume_fallback=false that point is an error record naming the checkpoint
    and the file, and the next point still runs; run again with the fallback (the default), the point resumes from
    the checkpoint before the damaged one and says so."""
    sweep = tmp_path / "sweep"
    args = ["-m", "ac=none,full", *SMALL, "trainer.checkpoint.every=1", f"hydra.sweep.dir={sweep}"]
    assert train_cli(*args, cwd=tmp_path).returncode == 0
    newest = sweep / "0" / "checkpoints" / "step_00000002"
    data = newest / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(100)
    for point in ("0", "1"):
        (sweep / point / "result.json").unlink()

    proc = train_cli(*args, "trainer.resume_fallback=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    error = json.loads((sweep / "0" / "result.json").read_text())["error"]
    assert error["type"] == "CheckpointDamaged" and (error["checkpoint"], error["file"]) == (str(newest), data.name)
    assert f"checkpoint {newest} is damaged: {data.name}: cut short: 100 bytes" in error["message"]
    assert json.loads((sweep / "1" / "result.json").read_text())["status"] == "ok"

    proc = train_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {newest} is damaged" in proc.stdout and "falling back to" in proc.stdout
    metrics = json.loads((sweep / "0" / "result.json").read_text())["metrics"]
    assert metrics["resumed_from"] == str(sweep / "0" / "checkpoints" / "step_00000001")
    assert metrics["damaged_checkpoints"][0]["set_aside_as"] == str(newest) + ".damaged"


@pytest.mark.slow
def test_a_fault_every_rank_finds_is_rank_0s_record_with_its_fields(tmp_path):
    """A damaged checkpoint named by trainer.resume, at 2 ranks: each rank refuses it alike, and the record is rank
    0's CheckpointDamaged naming the checkpoint and the file, as at one rank (not the launcher's RanksFailed)."""
    ranks = ["trainer.nproc_per_node=2", "parallel.ep=2", "data.batch_size=1"]
    first = train_cli(*SMALL, *ranks, "trainer.checkpoint.every=2", f"hydra.run.dir={tmp_path / 'a'}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000002"
    data = sorted(checkpoint.glob("*.distcp"))[0]
    with open(data, "r+b") as f:
        f.truncate(100)
    resumed = train_cli(
        *SMALL[1:], "trainer.steps=3", *ranks, f"trainer.resume={checkpoint}", f"hydra.run.dir={tmp_path / 'b'}",
        cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 1
    error = json.loads((tmp_path / "b" / "result.json").read_text())["error"]
    assert error["type"] == "CheckpointDamaged", error
    assert (error["checkpoint"], error["file"]) == (str(checkpoint), data.name)


def test_a_record_that_is_no_object_is_run_again_when_the_sweep_resumes(tmp_path):
    """A result.json that is JSON but no record (``[]``, an object without status and config) is not done: the
    resumed sweep runs its point again and replaces it."""
    from moe_lab.job.lifecycle import earlier_record
    from tests.test_offload import compose_train

    cfg = compose_train(SMALL)
    for text in ("[1, 2]", '"ok"', '{"status": "ok"}', '{"status": "ok", "config": []}'):
        (tmp_path / "result.json").write_text(text)
        assert earlier_record(tmp_path, cfg, multirun=True) is None and not (tmp_path / "result.json").exists()

    sweep = tmp_path / "sweep"
    args = ["-m", "ac=none", *SMALL, f"hydra.sweep.dir={sweep}"]
    assert train_cli(*args, cwd=tmp_path).returncode == 0
    (sweep / "0" / "result.json").write_text("[]")
    proc = train_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is no readable record: the point runs again" in proc.stdout
    assert json.loads((sweep / "0" / "result.json").read_text())["status"] == "ok"


def test_a_run_directory_in_use_is_refused(tmp_path):
    """Two single runs into one hydra.run.dir at once would mix their files: the second stops, naming the holder,
    before Hydra writes its .hydra/ files there (the lock held here by this test, as a running job holds it)."""
    import fcntl

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(run_dir / ".moe_lab.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write("a test's host pid 1\n")  # a lock of no kind (an older moe_lab's)
        lock.flush()
        proc = train_cli(*SMALL, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode != 0
    assert f"hydra.run.dir={run_dir} is in use by another process (a test's host pid 1)" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".moe_lab.lock"]
    proc = train_cli(*SMALL, f"hydra.run.dir={run_dir}", cwd=tmp_path)  # released: it runs
    assert proc.returncode == 0 and (run_dir / "result.json").exists(), proc.stderr[-3000:]


def test_a_finished_run_trains_longer_in_its_own_directory(tmp_path):
    """trainer.steps=2, then 4: refused (nothing lost), and the way the refusal offers works in the same directory:
    trainer.resume=<its checkpoint> continues it, its record replaced by the longer run's (which holds its steps).
    A resume that would run no step is refused naming trainer.steps, and the record stays; trainer.resume=never
    starts the directory afresh."""
    run_dir = tmp_path / "run"
    args = ["trainer.warmup_steps=1", "data.seq_len=16", "data.batch_size=1", "trainer.checkpoint.every=2"]
    args.append(f"hydra.run.dir={run_dir}")
    assert train_cli("trainer.steps=2", *args, cwd=tmp_path).returncode == 0
    short = json.loads((run_dir / "result.json").read_text())
    checkpoint = run_dir / "checkpoints" / "step_00000002"

    refused = train_cli("trainer.steps=4", *args, cwd=tmp_path)
    assert refused.returncode != 0 and "trainer.resume=<that checkpoint>" in refused.stderr, refused.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text()) == short

    longer = train_cli("trainer.steps=4", f"trainer.resume={checkpoint}", *args, cwd=tmp_path)
    assert longer.returncode == 0, longer.stdout[-2000:] + longer.stderr[-2000:]
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "ok" and record["config"]["trainer"]["steps"] == 4
    assert record["metrics"]["resumed_from"] == str(checkpoint)
    assert record["metrics"]["losses"][:2] == short["metrics"]["losses"] and len(record["metrics"]["losses"]) == 4
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [0, 1, 2, 3]

    nothing_to_run = train_cli(
        "trainer.steps=3", f"trainer.resume={run_dir / 'checkpoints' / 'step_00000004'}", *args, cwd=tmp_path
    )
    assert nothing_to_run.returncode == 1
    assert "invalid config: trainer.steps: is 3, but trainer.resume=" in nothing_to_run.stderr
    assert (
        "is at step 4: no step would run" in nothing_to_run.stderr
        and "of the run before is kept" in nothing_to_run.stderr
    )
    assert json.loads((run_dir / "result.json").read_text()) == record

    afresh = train_cli("trainer.steps=3", "trainer.resume=never", *args, cwd=tmp_path)
    assert afresh.returncode == 0, afresh.stderr[-2000:]
    record = json.loads((run_dir / "result.json").read_text())
    assert record["config"]["trainer"]["steps"] == 3 and record["metrics"]["resumed_from"] is None
    # the directory afresh: the 4-step run's checkpoints (steps 2 and 4) went, this run's step 2 is its own, not
    # skipped as "already there" nor pruned beside step 4
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000002"]
    marker = json.loads((run_dir / "checkpoints" / "step_00000002" / "checkpoint.json").read_text())
    assert marker["config"]["trainer"]["steps"] == 3
    assert "removed the 2 checkpoint(s) an earlier run left" in afresh.stdout + afresh.stderr


def test_a_finished_runs_record_survives_the_same_command_and_a_mistyped_resume(tmp_path):
    """The same command again on a run done to its last checkpoint keeps its record (resuming there would record a
    run of no step over the measured one); a trainer.resume that is not there is refused keeping it too; only
    trainer.resume=never runs it again."""
    run_dir = tmp_path / "run"
    args = [*SMALL, "trainer.steps=3", "trainer.checkpoint.every=3", f"hydra.run.dir={run_dir}"]
    assert train_cli(*args, cwd=tmp_path).returncode == 0
    done = json.loads((run_dir / "result.json").read_text())
    assert done["status"] == "ok" and done["metrics"]["s_per_step"] > 0

    again = train_cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and "run already done" in again.stdout + again.stderr, again.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text()) == done

    mistyped = train_cli(*args, f"trainer.resume={tmp_path / 'nope'}", cwd=tmp_path)
    assert mistyped.returncode == 1 and "of the run before is kept" in mistyped.stderr, mistyped.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text()) == done

    afresh = train_cli(*args, "trainer.resume=never", cwd=tmp_path)
    assert afresh.returncode == 0, afresh.stderr[-2000:]
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "ok" and record["started_utc"] >= done["started_utc"] and record != done
    assert json.loads((run_dir / "result.replaced.json").read_text()) == done  # the measurement before it, kept


def test_a_re_run_keeps_the_ok_record_it_replaces_and_drops_a_failed_one(tmp_path):
    """Cleared before the re-run starts (a failure before its own record must not read as the earlier one's): an
    ok record moves aside, so a re-run killed before recording loses no measurement; a failure is just removed."""
    from moe_lab.job.lifecycle import clear_earlier

    ok = {"status": "ok", "config": {}, "metrics": {"s_per_step": 1.0}}
    (tmp_path / "result.json").write_text(json.dumps(ok))
    clear_earlier(tmp_path)
    assert not (tmp_path / "result.json").exists()
    assert json.loads((tmp_path / "result.replaced.json").read_text()) == ok

    (tmp_path / "result.json").write_text(json.dumps({"status": "error", "config": {}}))
    clear_earlier(tmp_path)
    assert not (tmp_path / "result.json").exists()
    assert json.loads((tmp_path / "result.replaced.json").read_text()) == ok  # the failure replaced no measurement


def test_an_invalid_record_does_not_block_the_corrected_command(tmp_path):
    run_dir = tmp_path / "run"
    refused = train_cli(*SMALL, "parallel.ep=3", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert refused.returncode == 1 and f"(recorded in {run_dir / 'result.json'})" in refused.stderr
    assert json.loads((run_dir / "result.json").read_text())["status"] == "invalid"
    corrected = train_cli(*SMALL, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert corrected.returncode == 0, corrected.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text())["status"] == "ok"


def test_a_failed_run_says_in_one_line_where_it_is_recorded(tmp_path):
    """As a failed sweep point does: "failed, recorded in <path>: <type>: <message>", exit 1, no traceback (the
    record holds it)."""
    from tests.sweep import ROOT as SWEEP_ROOT

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"PYTHONPATH": str(ROOT), "MOE_LAB_INJECT": json.dumps([["error", {"ac": "none"}]])}
    proc = cli.train_cli(
        *SMALL, f"hydra.run.dir={run_dir}", cwd=tmp_path, env=env, script=str(SWEEP_ROOT / "tests" / "sweep.py")
    )
    assert proc.returncode == 1
    line = f"run failed, recorded in {run_dir / 'result.json'}: RuntimeError: injected by tests/sweep.py"
    assert line in proc.stdout and "Traceback" not in proc.stdout + proc.stderr, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )
    assert "injected by tests/sweep.py" in json.loads((run_dir / "result.json").read_text())["error"]["traceback"]


def test_a_sweep_ends_naming_its_directory_and_points_and_fails_when_none_is_ok(tmp_path):
    sweep = tmp_path / "sweep"
    mixed = train_cli("-m", "parallel.ep=1,3", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert mixed.returncode == 0, mixed.stderr[-2000:]
    assert f"sweep {sweep}: 2 points: " in mixed.stdout and "1 ok" in mixed.stdout and "1 invalid" in mixed.stdout

    sweep = tmp_path / "none_ok"
    failed = train_cli("-m", "parallel.ep=3,5", *SMALL, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert failed.returncode == 1
    assert f"sweep {sweep}: 2 points: 2 invalid" in failed.stdout and "no point ended ok" in failed.stderr


def test_a_signal_says_what_running_again_does(tmp_path):
    """No checkpoint: the same command starts over (not "resumes"); one of this point: it continues from it, unless
    trainer.resume names something else."""
    from moe_lab.checkpoint import directory
    from moe_lab.job.lifecycle import how_to_go_on
    from moe_lab.results.record import point_config
    from tests.test_offload import compose_train

    cfg = compose_train(SMALL)
    assert how_to_go_on(tmp_path, cfg, multirun=False).startswith(
        "No checkpoint was saved: the same command again starts from step 0"
    )
    saved = directory.complete_path(tmp_path / "checkpoints", 1)
    saved.mkdir(parents=True)
    (saved / directory.DCP_METADATA).write_bytes(b"")
    (saved / directory.MARKER).write_text(json.dumps({"step": 1, "config": point_config(cfg)}))
    assert how_to_go_on(tmp_path, cfg, multirun=False) == f"The same command again continues from {saved}."
    never = compose_train([*SMALL, "trainer.resume=never"])
    assert how_to_go_on(tmp_path, never, multirun=True) == (
        f"Running the same sweep again runs the rest; this point with trainer.resume=auto (not never) continues from {saved}."
    )


def test_a_mistyped_key_gets_moe_labs_message_before_hydras(tmp_path):
    """Not Hydra's advice to append it with +: the key named, what is allowed, nothing written."""
    for typo, expected in (
        ("dispacher=fused", "invalid config: dispacher: unknown top-level key; allowed: model, dispatcher, "),
        ("trainer.stpes=10", "invalid config: trainer.stpes: unknown key; allowed: steps, "),
    ):
        proc = train_cli(typo, cwd=tmp_path)
        assert proc.returncode == 1 and proc.stderr.startswith(expected), proc.stderr[-2000:]
        assert "To append" not in proc.stdout + proc.stderr and list(tmp_path.iterdir()) == []

    from moe_lab.config.validate import check_override_keys
    from moe_lab.runtime.errors import ConfigError

    # Sweeps, appended keys (checked once composed), Hydra's own and group options' known keys pass here.
    check_override_keys(
        ["ac=none,full", "+trainer.extra=1", "+offload.x=1", "hydra/launcher=basic", "hydra.run.dir=x"]
        + ["dispatcher=fused", "dispatcher.save=rows", "+experiment=grid_30b/two_gpu", "model.routing.kind=x"]
        + ["data._target_=my.Data"]
        + ["trainer.steps='5'", "trainer.steps=2,3", "trainer.steps=range(1,3)", "trainer.checkpoint.every=null"]
        + ["trainer.steps=${trainer.warmup_steps}", "trainer.min_lr_ratio=1"]  # as OmegaConf would store them
    )
    check_override_keys(["+experiment=full_depth", "dispatcher.save=inputs"])  # the preset chooses fused
    check_override_keys(["+experiment=full_depth,full_depth/seq32768", "ac.keep=[matmul]"])  # each chooses selective
    # grid_30b sweeps ac over full,selective under -m (its hydra.sweeper.params); one run of it has the default
    with pytest.raises(ConfigError, match=r"ac.keep: unknown key for ac=full \(the preset's\); allowed: no keys; ac="):
        check_override_keys(["+experiment=grid_30b", "ac.keep=[matmul]"], multirun=True)
    with pytest.raises(ConfigError, match=r"ac.keep: unknown key for ac=none \(the default\)"):
        check_override_keys(["+experiment=grid_30b", "ac.keep=[matmul]"])
    check_override_keys(["+experiment=grid_30b", "ac=selective", "ac.keep=[matmul]"], multirun=True)
    with pytest.raises(ConfigError, match="trainer.checkpoint.evry: unknown key; allowed: every, dir"):
        check_override_keys(["trainer.steps=4", "trainer.checkpoint.evry=2"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["dispatcher=fusd"], "dispatcher: no option 'fusd'; options: fused, torch"),
        (["ac=none,selectve"], "ac: no option 'selectve'; options: full, none, selective"),  # a sweep's too
        (["+experiment=grid_30"], "experiment: no option 'grid_30'; studies' presets: benchmark, "),
        (["experiment=grid_30b"], "experiment: a study's preset is appended: +experiment=<study>"),
        # the keys of the option in use (the default's, here; a chosen one's below)
        (
            ["dispatcher.sav=x"],
            "dispatcher.sav: no dispatcher option has this key; allowed with dispatcher=torch (the default): "
            "expert_precision, permute; dispatcher=fused has save",  # another option's key, mistyped
        ),
        (
            ["loss.chunk_token=8"],
            "loss.chunk_token: no loss option has this key; allowed with loss=chunked (the default)",
        ),
        (
            ["offload=optimizer", "offload.chunk_mb=1"],
            "offload.chunk_mb: no offload option has this key; allowed with offload=optimizer: chunk_mib, max_inflight",
        ),
        # the options chosen on the command line decide: torch has no save, nor has one point of a sweep
        (["dispatcher=torch", "dispatcher.save=rows"], "dispatcher.save: unknown key for dispatcher=torch; allowed: "),
        (["dispatcher=fused,torch", "dispatcher.save=rows"], "dispatcher.save: unknown key for dispatcher=torch"),
        # an option the command line leaves to train.yaml's default (Hydra would advise appending the key with +)
        (
            ["dispatcher.save=rows"],
            "dispatcher.save: unknown key for dispatcher=torch (the default); allowed: "
            "expert_precision, permute; dispatcher=fused has it",
        ),
        (
            ["ac=full", "ac.offload_activations=true"],
            "ac.offload_activations: unknown key for ac=full; allowed: no keys",
        ),
        # a schema key's value of the wrong type: named, where Hydra's merge error would stop every point of a sweep
        (["trainer.steps=abc"], "trainer.steps: expected int, got 'abc'"),
        (["trainer.steps=3,abc"], "trainer.steps: expected int, got 'abc'"),
        (["trainer.steps=null"], "trainer.steps: expected int, got None"),
        (["trainer.checkpoint.every=x"], "trainer.checkpoint.every: expected int or null, got 'x'"),
        (["trainer.deterministic=maybe"], "trainer.deterministic: expected bool, got 'maybe'"),
    ],
)
def test_a_mistyped_option_or_option_key_is_refused_before_hydra_composes(overrides, expected):
    """One line naming the group or key and what it allows, as for the schema's keys (the message train, plan and
    tune print), where Hydra would print its search path or advise appending the key with +."""
    from moe_lab.config.validate import check_override_keys
    from moe_lab.runtime.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        check_override_keys(overrides)
    assert str(refused.value).startswith(expected), str(refused.value)


def test_the_planner_and_the_tune_check_their_own_groups_keys():
    from moe_lab.config.validate import check_override_keys
    from moe_lab.plan.config import PlanConfig
    from moe_lab.runtime.errors import ConfigError
    from moe_lab.tune.config import TuneConfig

    check_override_keys(["hardware=b300", "hardware.nodes=4"], PlanConfig)
    check_override_keys(["tune.measure=0", "+tune.axes.ac.offload_activations=[false,true]"], TuneConfig)
    with pytest.raises(ConfigError, match="hardware: no option 'h300'; options: b200, b300, file, h100, h200"):
        check_override_keys(["hardware=h300"], PlanConfig)
    # a parameter of the option's class its yaml leaves to the default: Hydra needs it appended, and the message says so
    with pytest.raises(ConfigError, match=r"Hardware takes it: append it, \+hardware.fp8_dense_gemm_efficiency=..."):
        check_override_keys(["hardware.fp8_dense_gemm_efficiency=0.77"], PlanConfig)
    check_override_keys(["+hardware.fp8_dense_gemm_efficiency=0.77"], PlanConfig)
    with pytest.raises(ConfigError, match="tune.mesure: no tune option has this key; allowed: axes, device, "):
        check_override_keys(["tune.mesure=3"], TuneConfig)
    with pytest.raises(ConfigError, match="hardware: unknown top-level key"):  # train has no hardware
        check_override_keys(["hardware=b300"])


def test_a_dry_runs_counts_carry_their_prefix():
    from moe_lab.job.lifecycle import count

    assert [count(30.53e9), count(3.35e9), count(189_820), count(2_500_000), count(12)] == [
        "30.53B", "3.35B", "189.82K", "2.50M", "12",
    ]  # fmt: skip
    assert count(18.55e9, "G") == "18.55G"


def test_a_point_holding_another_configurations_record_is_counted_as_not_run(tmp_path):
    """A sweep run again after a point's config changed under the same overrides (a preset edited, say): that point
    is not run, its directory's record kept, and the sweep's last line counts it as not run, not as that record's
    ok."""
    sweep = tmp_path / "sweep"
    args = ["-m", "ac=none,full", *SMALL, f"hydra.sweep.dir={sweep}"]
    assert train_cli(*args, cwd=tmp_path).returncode == 0
    other = json.loads((sweep / "0" / "result.json").read_text())
    other["config"]["trainer"]["seed"] += 1  # as a run of another configuration left it
    (sweep / "0" / "result.json").write_text(json.dumps(other))
    proc = train_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = f"sweep {sweep}: 2 points: 1 not run (another configuration's record or checkpoint there), 1 ok"
    assert summary in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]
    assert json.loads((sweep / "0" / "result.json").read_text()) == other


def _rank_failure(tmp_path, rank: int, exitcode: int, exception: str | None = None, timestamp: int = 100):
    """A failed rank as elastic reports it: with the error file a rank that raised leaves, none for a signal."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error_rank{rank}.json"
    if exception:
        info = {"py_callstack": f"Traceback of rank {rank}", "timestamp": str(timestamp)}
        error_file.write_text(json.dumps({"message": {"message": exception, "extraInfo": info}}))
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))
    failure.timestamp = timestamp  # a rank with no error file is stamped when elastic saw it
    return failure


def test_within_one_second_the_rank_a_signal_killed_is_told_first(tmp_path):
    """Two ranks failed in the same second: the one killed (no exception of its own) explains the other's error, so
    the record names it first, with what a SIGKILL usually is."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from moe_lab.job.launcher import RanksFailed

    failures = {
        0: _rank_failure(tmp_path, 0, 1, "RuntimeError: Connection closed by peer"),
        1: _rank_failure(tmp_path, 1, -9),
    }
    failed = RanksFailed(ChildFailedError("worker", failures))
    assert str(failed) == (
        "rank 1 (pid 1001) died of signal SIGKILL (sent by kill -9, or by the kernel's out-of-memory killer); "
        "rank 0 (pid 1000) exited with code 1: RuntimeError: Connection closed by peer"
    )
    assert (failed.details["rank"], failed.details["signal"]) == (1, "SIGKILL")
    assert [r["rank"] for r in failed.details["ranks"]] == [1, 0]


def test_rank_0s_record_stands_only_where_every_rank_raised_its_error(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from moe_lab.job.launcher import raised_alike

    damaged = "CheckpointDamaged: checkpoint /c is damaged: __0_0.distcp: cut short"
    alike = {r: _rank_failure(tmp_path, r, 1, damaged) for r in (0, 1)}
    assert raised_alike(ChildFailedError("worker", alike), damaged)
    (tmp_path / "error_rank1.json").unlink()
    one_killed = {0: _rank_failure(tmp_path, 0, 1, damaged), 1: _rank_failure(tmp_path, 1, -9)}
    assert not raised_alike(ChildFailedError("worker", one_killed), damaged)


def test_how_a_point_is_run_is_no_part_of_the_point():
    """A record made with other settings of how to run it (skip_done, checkpointing, resume, resume_fallback) is
    still this point's, and a sweep run again with other such overrides is the same sweep."""
    from moe_lab.job.lifecycle import _point_overrides, same_point
    from moe_lab.results.record import point_config
    from tests.configs import compose_train

    cfg = compose_train(*SMALL)
    how = [
        "trainer.skip_done=false",
        "trainer.checkpoint.every=2",
        "trainer.resume=never",
        "trainer.resume_fallback=false",
    ]
    assert same_point({"config": point_config(compose_train(*SMALL, *how))}, cfg)
    assert not same_point({"config": point_config(compose_train(*SMALL, "trainer.seed=7"))}, cfg)
    assert _point_overrides(["ac=full", *how, "+trainer.checkpoint.dir=/c", "trainer.steps=4"]) == [
        "ac=full",
        "trainer.steps=4",
    ]


def test_a_resume_from_a_checkpoint_at_the_last_step_is_refused_as_running_no_step(tmp_path):
    from moe_lab.checkpoint.directory import MARKER
    from moe_lab.job.lifecycle import check_resume_step
    from moe_lab.results.record import point_config
    from moe_lab.runtime.errors import ConfigError
    from tests.configs import compose_train

    checkpoint = tmp_path / "step_00000004"
    checkpoint.mkdir()
    at_end = compose_train(*SMALL, "trainer.steps=4", f"trainer.resume={checkpoint}")
    (checkpoint / MARKER).write_text(json.dumps({"step": 4, "config": point_config(at_end)}))
    with pytest.raises(ConfigError, match=r"trainer.steps: is 4, but trainer.resume=.* is at step 4: no step would"):
        check_resume_step(at_end)
    check_resume_step(compose_train(*SMALL, "trainer.steps=5", f"trainer.resume={checkpoint}"))  # a step to run


def test_only_a_cpu_run_out_of_memory_is_told_to_shrink():
    """A GPU's OOM record is the error as raised; a CPU run's says it wants a GPU, or a smaller model."""
    import torch

    from moe_lab.job.lifecycle import failure_with_advice
    from moe_lab.results.record import Record

    base = Record({"config": {}})
    cpu = failure_with_advice(base, MemoryError("host memory: 20 GiB short"), None, torch.device("cpu"))
    assert cpu["status"] == "oom" and cpu["error"]["message"].startswith("host memory: 20 GiB short. ")
    assert "wants a GPU" in cpu["error"]["message"] and "model=tiny" in cpu["error"]["message"]
    gpu = failure_with_advice(base, torch.OutOfMemoryError("CUDA out of memory"), None, torch.device("cuda", 0))
    assert (gpu["status"], gpu["error"]["message"]) == ("oom", "CUDA out of memory")
    crash = failure_with_advice(base, RuntimeError("boom"), None, torch.device("cpu"))
    assert (crash["status"], crash["error"]["message"]) == ("error", "boom")


def test_the_checkpoint_a_point_continues_from_is_its_own_newest(tmp_path):
    """``trainer.resume=auto`` continues from the newest complete checkpoint, and only from one of this point: a
    newer one of another configuration is none to continue from (resume=auto refuses it)."""
    from moe_lab.checkpoint import directory
    from moe_lab.job.lifecycle import resumable_checkpoint
    from moe_lab.results.record import point_config
    from tests.configs import compose_train

    cfg = compose_train(*SMALL)

    def save(step: int, config) -> Path:
        saved = directory.complete_path(tmp_path / "checkpoints", step)
        saved.mkdir(parents=True)
        (saved / directory.DCP_METADATA).write_bytes(b"")
        (saved / directory.MARKER).write_text(json.dumps({"step": step, "config": point_config(config)}))
        return saved

    save(1, cfg)
    second = save(2, cfg)
    assert resumable_checkpoint(tmp_path, cfg) == second
    save(3, compose_train(*SMALL, "trainer.seed=7"))
    assert resumable_checkpoint(tmp_path, cfg) is None


def test_a_dry_run_sweep_whose_points_were_all_refused_fails(tmp_path, monkeypatch, capsys):
    """A refused point of a ``trainer.dry_run`` sweep is its invalid record, not a dry run counted: a sweep of
    nothing but refused points ends naming them and fails; one that counted a point does not."""
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from moe_lab.job.lifecycle import OutputDirGuard, SweepFailed

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)

    def sweep(name: str, returns: list[dict]) -> None:
        directory = tmp_path / name
        guard = OutputDirGuard()
        config = OmegaConf.create({"hydra": {"sweep": {"dir": str(directory)}}, "trainer": {"dry_run": True}})
        guard.on_multirun_start(config)
        for n, value in enumerate(returns):
            if "status" in value:  # a refused point leaves its record
                (directory / str(n)).mkdir()
                (directory / str(n) / "result.json").write_text(json.dumps({**value, "config": {}}))
            point = OmegaConf.merge(config, {"hydra": {"runtime": {"output_dir": str(directory / str(n))}}})
            guard.on_job_end(point, JobReturn(status=JobStatus.COMPLETED, _return_value=value))
        guard.on_multirun_end(config)

    counted = {"total_params": 1, "active_params": 1, "flops_per_token": 6}
    sweep("mixed", [counted, {"status": "invalid"}])
    assert f"sweep {tmp_path / 'mixed'}: 2 points: 1 invalid, 1 dry run (counted, nothing recorded)" in (
        capsys.readouterr().out
    )
    with pytest.raises(SweepFailed, match="no point ended ok"):
        sweep("refused", [{"status": "invalid"}, {"status": "invalid"}])
    assert f"sweep {tmp_path / 'refused'}: 2 points: 2 invalid\n" in capsys.readouterr().out
