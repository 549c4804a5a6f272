"""Training checkpoints and signals, on real jobs (issue 17): ``python -m moe_lab.train`` in a subprocess, killed or
signalled while a test data option holds it at a chosen step (``tests.pausing_data``).

- Exact: a run killed with SIGKILL after its step-8 checkpoint (two steps later: metrics.jsonl then holds rows the
  checkpoint does not) and run again (``trainer.resume=auto``, same run directory) reaches step 16 with the losses
  of an uninterrupted 16-step run, bit for bit, for offload none / optimizer / full at world 1 and for offload
  optimizer at world 2 (EP 1: experts sharded by FSDP); its metrics.jsonl holds each step once and its record the
  losses of all 16. World 2 needs no more cases of its own: what the kill adds (rows past the checkpoint dropped, the
  newest checkpoint found) is rank 0's and proven at world 1 for every offload mode; offload full at world 2 / EP 2
  resumes bit for bit in the SIGTERM test below (the chunked optimizer state of offload optimizer and full alike),
  and offload none at world 2 / EP 2 in tests/test_checkpointer.py (test_background_save_at_world2_ep2_resumes_exactly).
- Resharding: a checkpoint resumed at another world size or EP degree continues the loss curve of the run at that
  mesh within fp32 summation-order tolerance (relative 1e-5; every mesh shape trains like one rank on the same
  global batch, tests/test_distributed_training.py), its first 8 losses being the checkpoint's own.
- Continued and changed: a finished run continued with more steps (``trainer.resume`` naming its last checkpoint,
  in its run directory) runs each later step at the LR of a fresh run of the new config, with another warmup and
  floor too, and from inside its warmup; a resume with another ``optimizer.lr`` steps at the new config's LR; one
  with another optimizer class (adamw -> signsgd) is refused naming ``optimizer``.
- Signals: SIGTERM to the launcher of two ranks stops both at the same step, saves a checkpoint there
  (``on_signal``), records ``interrupted`` and exits 143, and the run resumes from it bit for bit; SIGINT ends a
  single run with 130 and an ``interrupted`` record; in a sweep the signalled point is recorded and the sweep stops,
  and running it again resumes that point from its checkpoint and runs the rest.

Every rank computes with one thread (one CPU for a one-rank job): the same arithmetic in every attempt (the thread
count changes float sums), and no oversubscribed OpenMP spinning on a shared machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli import start_train
from tests.pausing_data import PAUSE

pytestmark = pytest.mark.slow  # killed and resumed jobs, one and two ranks

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 2  # per rank: GLOBAL_BATCH // ranks, so every mesh sees the same global batch
BASE = [
    "trainer.steps=16",
    "trainer.warmup_steps=2",
    "data.seq_len=16",
    "data._target_=tests.pausing_data.PausingData",
    "trainer.checkpoint.every=8",
    "trainer.eval_every=4",  # held-out losses and the expert load are the whole run's too
    "trainer.eval_batches=1",
]
# Several chunks and fewer transfer buffers than chunks for the offload modes.
CHUNKS = ["offload.chunk_mib=0.05", "offload.max_inflight=2"]
KILLED = [("none", 1, 1), ("optimizer", 1, 1), ("full", 1, 1), ("optimizer", 2, 1)]  # the module docstring says why


def mesh(offload: str, ranks: int, ep: int) -> list[str]:
    chunks = CHUNKS if offload != "none" else []
    return [
        f"offload={offload}",
        f"trainer.nproc_per_node={ranks}",
        f"parallel.ep={ep}",
        f"data.batch_size={GLOBAL_BATCH // ranks}",
        *chunks,
    ]


def case_id(case) -> str:
    return "{}-world{}-ep{}".format(*case)


class Job:
    """``python -m moe_lab.train ARGS`` in a session of its own (a kill reaches its ranks too), output to files."""

    def __init__(self, args: list[str], directory: Path, pause: str | None = None):
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", PAUSE)}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])), OMP_NUM_THREADS="1")
        if pause:
            env[PAUSE] = pause
        directory.mkdir(parents=True, exist_ok=True)
        self.log = directory / "job.out"
        # One rank: one CPU (offload=full sizes its host threads by the CPUs it may use). Two: a CPU each.
        cpus = sorted(os.sched_getaffinity(0))[: 1 if "trainer.nproc_per_node=2" not in args else 2]
        self.log.write_text("")
        # Forked from a process that imported moe_lab.train (tests/cli.py); its ranks fork from its own forkserver.
        self.proc = start_train(args, directory, str(self.log), str(self.log), env, new_session=True, cpus=cpus)

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"job still running after {timeout} s:\n{self.output()[-5000:]}")

    def wait_for(self, condition, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                pytest.fail(f"job ended ({self.proc.returncode}) before the awaited state:\n{self.output()[-5000:]}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"awaited state not reached after {timeout} s:\n{self.output()[-5000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def run(args: list[str], directory: Path) -> Job:
    job = Job(args, directory)
    assert job.wait() == 0, job.output()[-5000:]
    return job


def paused(pause_dir: Path, ranks: int):
    return lambda: all((pause_dir / f"paused_rank{r}").exists() for r in range(ranks))


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 16-step run of a case: its run directory (with checkpoints of steps 8 and 16)."""
    done = {}

    def get(case) -> Path:
        if case not in done:
            run_dir = tmp_path_factory.mktemp(case_id(case)) / "run"
            run([*BASE, *mesh(*case), f"hydra.run.dir={run_dir}"], run_dir.parent)
            assert result(run_dir)["status"] == "ok"
            done[case] = run_dir
        return done[case]

    return get


@pytest.mark.parametrize("case", KILLED, ids=case_id)
def test_killed_run_resumes_bit_for_bit(case, reference, tmp_path):
    expected = result(reference(case))["metrics"]["losses"]
    run_dir, pause_dir = tmp_path / "run", tmp_path / "pause"
    args = [*BASE, *mesh(*case), f"hydra.run.dir={run_dir}"]
    killed = Job(args, tmp_path, pause=f"10:{pause_dir}")
    killed.wait_for(paused(pause_dir, case[1]))
    killed.kill()
    assert not (run_dir / "result.json").exists()
    assert [row["step"] for row in metrics_rows(run_dir)] == list(range(10))  # two rows past the checkpoint
    assert checkpoints(run_dir) == ["step_00000008"]

    run(args, tmp_path)
    record = result(run_dir)
    assert record["status"] == "ok"
    assert record["metrics"]["resumed_from"] == str(run_dir / "checkpoints" / "step_00000008")
    assert record["metrics"]["losses"] == expected  # bit for bit
    uninterrupted = result(reference(case))["metrics"]
    assert [e["step"] for e in record["metrics"]["eval_losses"]] == [3, 7, 11, 15]
    assert record["metrics"]["eval_losses"] == uninterrupted["eval_losses"]
    assert record["metrics"]["expert_load"] == uninterrupted["expert_load"]
    rows = metrics_rows(run_dir)
    assert [row["step"] for row in rows] == list(range(16)) and [row["loss"] for row in rows] == expected
    assert checkpoints(run_dir) == ["step_00000008", "step_00000016"]


def test_a_run_stopped_between_its_last_checkpoint_and_its_record_is_timed_by_its_steps(reference, tmp_path):
    """Killed after the last step's checkpoint, before result.json: run again, no step is left. Its record is ok
    and times the steps metrics.jsonl kept (after trainer.timing_skip), saying so, with no peak memory (the
    process that wrote it held no step): not a record without throughput that a sweep then skips as done."""
    import shutil
    import statistics

    run_dir = tmp_path / "run"
    shutil.copytree(reference(("none", 1, 1)), run_dir)
    (run_dir / "result.json").unlink()
    run([*BASE, *mesh("none", 1, 1), f"hydra.run.dir={run_dir}"], tmp_path)
    record = result(run_dir)
    metrics = record["metrics"]
    assert record["status"] == "ok" and metrics["resumed_from"] == str(run_dir / "checkpoints" / "step_00000016")
    times = [row["s_per_step"] for row in metrics_rows(run_dir)]
    assert len(times) == 16 and metrics["timed_steps"] == 16 - record["config"]["trainer"]["timing_skip"]
    assert metrics["s_per_step"] == statistics.median(times[-metrics["timed_steps"] :])
    assert metrics["timed_by_earlier_attempts"] is True
    assert metrics["peak_host_rss_gib"] is None and metrics["peak_gpu_mem_gib"] is None
    assert metrics["losses"] == result(reference(("none", 1, 1)))["metrics"]["losses"]


@pytest.mark.parametrize(
    "saved, resumed",
    [(("none", 1, 1), ("none", 2, 2)), (("full", 2, 2), ("full", 1, 1))],  # world size and EP degree, each way
    ids=lambda case: case_id(case),
)
def test_resume_at_another_mesh_continues_the_curve(saved, resumed, reference, tmp_path):
    checkpoint = reference(saved) / "checkpoints" / "step_00000008"
    run_dir = tmp_path / "run"
    run([*BASE, *mesh(*resumed), f"trainer.resume={checkpoint}", f"hydra.run.dir={run_dir}"], tmp_path)
    losses = result(run_dir)["metrics"]["losses"]
    saved_losses = result(reference(saved))["metrics"]["losses"]
    assert losses[:8] == saved_losses[:8]  # the checkpoint's own
    assert losses[8:] == pytest.approx(result(reference(resumed))["metrics"]["losses"][8:], rel=1e-5)
    assert losses[8:] != pytest.approx(losses[:8], rel=1e-3)  # it trained on
    # the whole run's expert load, the checkpoint's share once (not per rank, not lost): every token's 2 experts
    tokens = result(run_dir)["metrics"]["expert_load"]["tokens"]
    assert [sum(layer) for layer in tokens] == [16 * GLOBAL_BATCH * 16 * 2] * len(tokens)


def lrs(run_dir: Path) -> list[float]:
    """The LR column of a run's metrics.jsonl, a row per step."""
    return [row["lr"] for row in metrics_rows(run_dir)]


SMALL = ["data.seq_len=16", f"data.batch_size={GLOBAL_BATCH}"]
# A finished run's steps (the defaults otherwise), and the settings it is continued with: more steps; another
# warmup and floor as well; from a run that ended inside its warmup (trainer.warmup_steps=10, the default).
CONTINUED = {
    "longer": (40, ["trainer.steps=80"]),
    "warmup_changed": (40, ["trainer.steps=80", "trainer.warmup_steps=50", "trainer.min_lr_ratio=0.5"]),
    "from_inside_warmup": (8, ["trainer.steps=16"]),
}


@pytest.mark.parametrize("name", CONTINUED)
def test_a_continued_run_follows_the_longer_runs_schedule(name, tmp_path):
    first_steps, continued = CONTINUED[name]
    run_dir, fresh_dir = tmp_path / "run", tmp_path / "fresh"
    every = f"trainer.checkpoint.every={first_steps}"
    run([*SMALL, f"trainer.steps={first_steps}", every, f"hydra.run.dir={run_dir}"], tmp_path)
    first_lrs = lrs(run_dir)
    checkpoint = run_dir / "checkpoints" / f"step_{first_steps:08d}"
    run([*SMALL, *continued, every, f"trainer.resume={checkpoint}", f"hydra.run.dir={run_dir}"], tmp_path)
    run([*SMALL, *continued, f"hydra.run.dir={fresh_dir}"], tmp_path)
    assert result(run_dir)["metrics"]["resumed_from"] == str(checkpoint)
    assert lrs(run_dir)[:first_steps] == first_lrs  # its rows before the checkpoint are kept
    assert lrs(run_dir)[first_steps:] == lrs(fresh_dir)[first_steps:]  # bit for bit


def test_a_resume_with_another_lr_steps_at_it(reference, tmp_path):
    """The checkpoint's param groups hold AdamW's LR where the schedule left it: the new config's schedule wins."""
    saved = reference(("none", 1, 1))
    new_lr = ["optimizer.lr=0.0003"]
    args = [*BASE, *mesh("none", 1, 1), *new_lr]
    run(
        [*args, f"trainer.resume={saved / 'checkpoints' / 'step_00000008'}", f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )
    run([*args, f"hydra.run.dir={tmp_path / 'fresh'}"], tmp_path)
    assert [row["step"] for row in metrics_rows(tmp_path / "run")] == list(range(8, 16))  # a new run directory
    assert lrs(tmp_path / "run") == lrs(tmp_path / "fresh")[8:] != lrs(saved)[8:]
    assert result(tmp_path / "run")["metrics"]["losses"][8:] != result(saved)["metrics"]["losses"][8:]


def test_a_resume_with_another_optimizer_is_refused_naming_it(reference, tmp_path):
    checkpoint = reference(("none", 1, 1)) / "checkpoints" / "step_00000008"
    run_dir = tmp_path / "run"
    job = Job(
        [*BASE, *mesh("none", 1, 1), "optimizer=signsgd", f"trainer.resume={checkpoint}", f"hydra.run.dir={run_dir}"],
        tmp_path,
    )
    assert job.wait() == 1, job.output()[-5000:]
    record = result(run_dir)  # refused as the config is validated: an invalid record, nothing built
    assert record["status"] == "invalid" and record["error"]["message"].startswith(
        f"optimizer: trainer.resume={checkpoint}: it holds the state of torch.optim.AdamW, this run's optimizer is "
        "moe_lab.optim.optimizers.SignSGD"
    )


def test_sigterm_to_the_launcher_stops_both_ranks_at_one_step_and_resumes(reference, tmp_path):
    case = ("full", 2, 2)
    expected = result(reference(case))["metrics"]["losses"]
    run_dir, pause_dir = tmp_path / "run", tmp_path / "pause"
    args = [*BASE, *mesh(*case), "trainer.checkpoint.on_signal=true", f"hydra.run.dir={run_dir}"]
    job = Job(args, tmp_path, pause=f"5:{pause_dir}")
    job.wait_for(paused(pause_dir, 2))
    job.proc.send_signal(signal.SIGTERM)  # the launcher only; it forwards the signal to its ranks
    time.sleep(0.5)  # both ranks have noted it (or the launcher's forwarding is under way) while held at step 5
    (pause_dir / "release").touch()
    assert job.wait() == 128 + signal.SIGTERM, job.output()[-5000:]
    assert job.output().count("SIGTERM received: stopping at the end of this step") == 2  # each rank noted it

    record = result(run_dir)
    assert record["status"] == "interrupted" and record["world_size"] == 2 and record["environment"]["world_size"] == 2
    error = record["error"]
    assert error["signal"] == "SIGTERM" and error["step"] == 6
    assert error["checkpoint"] == str(run_dir / "checkpoints" / "step_00000006")
    assert record["metrics"]["steps_done"] == 6 and record["metrics"]["losses"] == expected[:6]
    assert checkpoints(run_dir) == ["step_00000006"]

    run(args, tmp_path)
    record = result(run_dir)
    assert record["status"] == "ok" and record["metrics"]["losses"] == expected
    assert [row["step"] for row in metrics_rows(run_dir)] == list(range(16))


def test_sigterm_to_the_whole_process_group_is_recorded_at_the_step_the_ranks_reached(tmp_path):
    # As a scheduler or `timeout` sends it: the launcher, its ranks and the forkserver they forked from all get it.
    # The launcher waits on its ranks through that server, so it must outlive the signal: else the launcher read no
    # record yet, wrote its own "before training started" and exited while rank 0 still wrote the step it reached.
    run_dir, pause_dir = tmp_path / "run", tmp_path / "pause"
    job = Job([*BASE, *mesh("none", 2, 2), f"hydra.run.dir={run_dir}"], tmp_path, pause=f"5:{pause_dir}")
    job.wait_for(paused(pause_dir, 2))
    os.killpg(job.proc.pid, signal.SIGTERM)
    job.wait_for(lambda: job.output().count("SIGTERM received: stopping at the end of this step") >= 2)
    (pause_dir / "release").touch()
    assert job.wait() == 128 + signal.SIGTERM, job.output()[-5000:]
    assert "SIGTERM received: stopped after step 6; recorded in" in job.output()
    record = result(run_dir)
    assert record["status"] == "interrupted" and record["error"]["step"] == 6
    assert record["metrics"]["steps_done"] == 6 and record["environment"]["world_size"] == 2


def test_sigint_ends_a_single_run_with_an_interrupted_record(tmp_path):
    run_dir, pause_dir = tmp_path / "run", tmp_path / "pause"
    job = Job([*BASE, *mesh("none", 1, 1), f"hydra.run.dir={run_dir}"], tmp_path, pause=f"3:{pause_dir}")
    job.wait_for(paused(pause_dir, 1))
    job.proc.send_signal(signal.SIGINT)
    job.wait_for(lambda: "SIGINT received" in job.output())
    (pause_dir / "release").touch()
    assert job.wait() == 128 + signal.SIGINT, job.output()[-5000:]
    record = result(run_dir)
    assert record["status"] == "interrupted" and record["error"]["step"] == 4 and record["error"]["checkpoint"] is None
    assert record["environment"]["torch"] and len(record["metrics"]["losses"]) == 4
    assert (
        record["metrics"]["peak_gpu_mem_gib"] is None and record["metrics"]["peak_host_rss_gib"] > 0
    )  # as a failure's
    assert not (run_dir / "checkpoints").exists()  # on_signal is off and no step reached trainer.checkpoint.every
    assert "No checkpoint was saved: the same command again starts from step 0" in job.output()  # not "resume"


def test_a_signalled_sweep_stops_and_resumes_its_point(reference, tmp_path):
    expected = result(reference(("none", 1, 1)))["metrics"]["losses"]
    sweep, pause_dir = tmp_path / "sweep", tmp_path / "pause"
    args = [
        "-m",
        "ac=none,full",
        *BASE,
        *mesh("none", 1, 1),
        "trainer.checkpoint.on_signal=true",
        f"hydra.sweep.dir={sweep}",
    ]
    job = Job(args, tmp_path, pause=f"5:{pause_dir}")
    job.wait_for(paused(pause_dir, 1))
    job.proc.send_signal(signal.SIGTERM)
    job.wait_for(lambda: "SIGTERM received" in job.output())
    (pause_dir / "release").touch()
    assert job.wait() == 128 + signal.SIGTERM, job.output()[-5000:]
    assert result(sweep / "0")["status"] == "interrupted" and not (sweep / "1").exists()
    checkpoint = sweep / "0" / "checkpoints" / "step_00000006"
    assert f"Running the same sweep again runs the rest; this point continues from {checkpoint}." in job.output()

    run(args, tmp_path)
    first, second = result(sweep / "0"), result(sweep / "1")
    assert first["status"] == second["status"] == "ok"
    assert first["metrics"]["resumed_from"] == str(sweep / "0" / "checkpoints" / "step_00000006")
    assert first["metrics"]["losses"] == expected and second["metrics"]["resumed_from"] is None
