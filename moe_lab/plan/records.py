"""Plans of measured points: a run's record (``result.json``) or a benchmark program's point (its command line),
planned on the hardware it ran on, beside what it measured."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

from omegaconf import OmegaConf

from moe_lab.plan.config import compose
from moe_lab.plan.planner import plan

HARDWARE_OF_GPU = {"H200": "h200", "H100": "h100", "B200": "b200", "B300": "b300"}


def _hardware(gpu: str | None, world: int) -> list[str]:
    name = next((v for k, v in HARDWARE_OF_GPU.items() if gpu and k in gpu), "h200")
    return [f"hardware={name}", f"hardware.gpus_per_node={world}"]


def record_overrides(record: dict) -> list[str]:
    """The overrides that give a record's configuration today: its own (group choices, preset), then every value of
    its resolved config that today's config still has (a key added since keeps its default)."""
    env = record.get("environment") or {}
    return [o for o in record.get("overrides") or []] + _hardware(env.get("gpu"), int(record.get("world_size") or 1))


# The commit from which the fused dispatcher's buffers follow the rows received (before it: the worst case).
FUSED_RECEIVED_ROWS = "0c0883f"


def made_before(record: dict, commit: str, repo: Path = Path(__file__).resolve().parents[2]) -> bool:
    """Whether the code a record names (``environment.git_commit``) lacks ``commit``; a record naming no commit
    git knows here is taken to be older."""
    made = (record.get("environment") or {}).get("git_commit")
    if not made:
        return True
    done = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", commit, made], capture_output=True)
    return done.returncode != 0


def plan_record(record: dict, extra: list[str] = ()) -> dict:
    cfg = compose(record_overrides(record) + list(extra))
    measured = OmegaConf.create(record["config"])
    for section in ("model", "data", "trainer", "parallel", "dispatcher", "ac", "offload", "optimizer"):
        if section in measured:
            keep = {k: v for k, v in OmegaConf.to_container(measured[section]).items() if k in cfg[section] and k != "_target_"}
            cfg[section] = OmegaConf.merge(cfg[section], keep)
    return plan(cfg, fused_worst_case=made_before(record, FUSED_RECEIVED_ROWS))


def plan_command(command: str, gpu: str, world: int = 1, extra: list[str] = ()) -> dict:
    """A benchmark program's point, given as its ``python -m moe_lab.train ...`` command line."""
    overrides = [a for a in shlex.split(command) if "=" in a and not a.startswith("hydra.")]
    return plan(compose(overrides + _hardware(gpu, world) + list(extra)))


def read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
