"""A small real CPU sweep for the record, resume and notebook tests, and its entry point.

``python tests/sweep.py <hydra args>`` is ``python -m moe_lab.train`` with failures injected for chosen points: the
environment variable MOE_LAB_INJECT (read only here) holds a JSON list of [kind, {group: option}] where kind is
"oom" (a CUDA out-of-memory error) or "error" (a crash), raised as the point starts training.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]
INJECT = [
    ["oom", {"ac": "full", "optimizer": "signsgd"}],
    ["error", {"ac": "selective", "optimizer": "signsgd"}],
]
# 12 points: ep=3 does not divide the tiny model's 8 experts (6 invalid), 2 injected failures, 4 ok points.
SWEEP_ARGS = [
    "-m",
    "ac=none,full,selective",
    "optimizer=adamw,signsgd",
    "parallel.ep=1,3",
    "trainer.steps=4",
    "data.seq_len=32",
    "data.batch_size=2",
    "profile.enabled=true",
    "profile.wait=1",
    "profile.warmup=1",
    "profile.active=1",
]
EXPECTED = {  # (ac, optimizer, ep) -> status
    (ac, opt, ep): "invalid"
    if ep == "3"
    else {("full", "signsgd"): "oom", ("selective", "signsgd"): "error"}.get((ac, opt), "ok")
    for ac in ("none", "full", "selective")
    for opt in ("adamw", "signsgd")
    for ep in ("1", "3")
}


def run_sweep(sweep_dir: Path, inject=INJECT, extra=()) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOE_LAB_INJECT": json.dumps(inject), "PYTHONPATH": str(ROOT)}
    from tests.cli import train_cli

    args = [*SWEEP_ARGS, f"hydra.sweep.dir={sweep_dir}", *extra]
    return train_cli(*args, cwd=sweep_dir.parent, env=env, timeout=600, script=str(Path(__file__)))  # forked


def ensure_sweep(base: Path) -> Path:
    """The sweep, made once under ``base`` (conftest's ``shared_tmp_path``: once per session, whichever xdist worker
    asks first; the others wait for it)."""
    sweep_dir = base / "sweep"
    with FileLock(base / "sweep.lock"):
        if not (base / "sweep.done").exists():
            proc = run_sweep(sweep_dir)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            (base / "sweep.done").write_text(proc.stdout)
    return sweep_dir


def _inject() -> None:
    import torch
    from hydra.core.hydra_config import HydraConfig

    import moe_lab.job.trainer
    import moe_lab.parallel

    rules = json.loads(os.environ.get("MOE_LAB_INJECT", "[]"))
    real_parallelize = moe_lab.parallel.parallelize

    def parallelize(*args, **kwargs):  # the first thing a point's training does
        choices = HydraConfig.get().runtime.choices
        for kind, match in rules:
            if all(choices.get(k) == v for k, v in match.items()):
                if kind == "oom":
                    raise torch.OutOfMemoryError(
                        "CUDA out of memory. Tried to allocate 2.00 GiB (injected by tests/sweep.py)"
                    )
                raise RuntimeError("injected by tests/sweep.py")
        return real_parallelize(*args, **kwargs)

    # Where the job calls it too: its module may be imported already (a process forked by tests/cli.py).
    moe_lab.parallel.parallelize = moe_lab.job.trainer.parallelize = parallelize


if __name__ == "__main__":
    _inject()
    # Run the entry point as `python -m moe_lab.train` would (Hydra finds conf/ relative to the main file).
    runpy.run_module("moe_lab.train", run_name="__main__", alter_sys=True)
