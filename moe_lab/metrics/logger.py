"""Experiment loggers: the ``logger`` config group. Each option is one class, built on rank 0 only.

A logger is told ``start(run_dir, record)`` before the first step (record: choices, overrides, sweep, resolved
config, environment), ``log(row, step)`` after each step, and ``finish(result)`` at the end, also when the run
failed; ``where()`` then says, in lines for the run's log, where it put the run and how to reach it. Console
progress (``moe_lab.metrics.progress``: loss and s/step) needs no logger.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable


@runtime_checkable
class ExperimentLogger(Protocol):
    """What a ``logger`` option provides; the job calls these on rank 0 only, in this order."""

    def validate(self, cfg, target) -> None:
        """Refuse, with a ``ConfigError`` naming the key, a composed config this logger cannot log (``target``: where
        it runs, ``moe_lab.runtime.device.Target``); the default accepts every config."""

    def start(self, run_dir: Path, record: dict) -> None:
        """Before the first step: ``record`` is the point's record so far (choices, overrides, sweep, resolved
        config, environment)."""
        ...

    def log(self, row: dict, step: int) -> None:
        """After each step: the step's metrics row, as metrics.jsonl gets it."""
        ...

    def finish(self, result: dict) -> None:
        """At the end, also when the run failed: the point's result record."""
        ...

    def where(self) -> list[str]:
        """Lines for the run's log saying where the logger put the run and how to reach it (after ``finish``)."""
        ...


class NoLogger(ExperimentLogger):
    """Nothing beyond metrics.jsonl and result.json."""

    def start(self, run_dir: Path, record: dict) -> None:
        pass

    def log(self, row: dict, step: int) -> None:
        pass

    def finish(self, result: dict) -> None:
        pass

    def where(self) -> list[str]:
        return []


class WandbLogger(ExperimentLogger):
    """Weights & Biases, offline by default (``logger.mode=online`` to sync as it runs; an offline run is uploaded
    later with ``wandb sync <run_dir>/wandb/offline-run-*``). The run's group is the sweep directory, its tags the
    group choices, its config the resolved config. Every file wandb writes goes under the run directory."""

    def __init__(
        self,
        project: str = "moe_lab",
        entity: str | None = None,
        mode: Literal["offline", "online", "disabled"] = "offline",
        group: str | None = None,
        name: str | None = None,
    ):
        self.project, self.entity, self.mode, self.group, self.name = project, entity, mode, group, name
        self.run = None
        self.saved_env: dict[str, str | None] = {}
        self.location: list[str] = []

    DIRS = {
        "WANDB_CACHE_DIR": "cache",
        "WANDB_DATA_DIR": "data",
        "WANDB_CONFIG_DIR": "config",
        "WANDB_ARTIFACT_DIR": "artifacts",
    }

    def start(self, run_dir: Path, record: dict) -> None:
        import wandb  # lazily: the GPU machines do not have it

        root = Path(run_dir).resolve() / "wandb"
        root.mkdir(parents=True, exist_ok=True)
        # wandb's cache, staging and settings directories default to ~/.cache, ~/.local/share and ~/.config.
        self.saved_env = {var: os.environ.get(var) for var in self.DIRS}
        os.environ.update({var: str(root / sub) for var, sub in self.DIRS.items()})
        choices = record.get("choices", {})
        self.run = wandb.init(
            project=self.project,
            entity=self.entity,
            mode=self.mode,
            dir=str(root.parent),
            group=self.group or record.get("sweep"),
            name=self.name or "-".join(f"{k}={v}" for k, v in choices.items() if k != "logger"),
            tags=[f"{k}={v}"[:64] for k, v in choices.items()],
            config=record.get("config"),
            settings=wandb.Settings(console="off", silent=True),
            reinit="finish_previous",
        )

    def log(self, row: dict, step: int) -> None:
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def finish(self, result: dict) -> None:
        if self.run is None:
            return
        metrics = result.get("metrics") or {}
        times = (metrics.get("trace_breakdown") or {}).get("seconds", {})
        self.run.summary.update(
            {
                "status": result["status"],
                **{k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                **{f"time.{k}": v for k, v in times.items()},
            }
        )
        if result.get("error"):
            self.run.summary["error"] = f"{result['error']['type']}: {result['error']['message']}"[:1000]
        run_dir = Path(self.run.dir).parent  # wandb/offline-run-<time>-<id> (the run's files are in its files/)
        if self.mode == "offline":
            self.location = [f"wandb offline run: {run_dir}", f"upload it with: wandb sync {run_dir}"]
        elif self.mode == "online":
            self.location = [f"wandb run: {self.run.url}"]
        self.run.finish(exit_code=0 if result["status"] == "ok" else 1)
        self.run = None
        for var, value in self.saved_env.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value

    def where(self) -> list[str]:
        return self.location
