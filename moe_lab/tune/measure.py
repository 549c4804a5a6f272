"""The candidates measured on the device at hand as one ordinary ``python -m moe_lab.train -m`` sweep into the tune's
``measured/`` (``hydra/sweeper=candidates``: the shared overrides once per candidate), each point a normal record:
real ranks where the layout fits this machine, else one emulated rank of it (``parallel.emulate``). Candidates that
ran out of memory are replaced by points planned to hold less than any that ran out, measured as a sweep of their
own (``measured_2/``, ...). The same tune command resumes the sweeps as any sweep resumes (``trainer.skip_done``)."""

from __future__ import annotations

import math
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from moe_lab import config
from moe_lab.config import ConfigError
from moe_lab.metrics.flops import hardware_option
from moe_lab.metrics.progress import ConsoleProgress
from moe_lab.optim.offload.host import usable_host_bytes
from moe_lab.plan.hardware import GIB, Hardware
from moe_lab.plan.planner import HOST_PROCESS
from moe_lab.results.record import RESULT, read_result
from moe_lab.results.tune import round_files, run_dir_of
from moe_lab.runtime.paths import CONF_DIR
from moe_lab.tune import config as tune_config

POLL_S = 2.0


@dataclass
class Layout:
    """Where the candidates run: ``device`` (cuda | cpu), the tune's mesh (``nodes`` x ``gpus_per_node`` of profile
    ``hardware``) and whether this machine holds it (real ranks) or runs one rank of it (``emulated``)."""

    device: str
    nodes: int
    gpus_per_node: int
    hardware: str
    emulated: bool

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def overrides(self) -> list[str]:
        out = [f"trainer.nproc_per_node={self.gpus_per_node}"]
        if self.emulated:
            out += ["parallel.emulate=true", f"parallel.emulate_nodes={self.nodes}"]
            out += [f"parallel.emulate_hardware={self.hardware}"]
        if self.device == "cpu":
            out.append("trainer.device=cpu")
        return out

    def describe(self) -> str:
        mesh = f"{self.world} x {self.hardware} ({self.nodes} x {self.gpus_per_node})"
        if self.emulated:
            return f"rank 0 of {mesh}, emulated on one {self.device}"
        # on the CPU (a test of the machinery) the ranks are processes, not the profile's GPUs
        return f"{mesh} on real ranks" if self.device == "cuda" else f"the {mesh} layout's ranks on the CPU"


def unmeasurable_here(layout: Layout, base: list[str]):
    """``unmeasurable`` for ``planning.candidates``: why this machine cannot measure a point, or None. Its training
    config, as the sweep will run it, must validate here (``precision=fp8`` without torchao, say, is refused on
    this machine where the plan's GPU allowed it); and its node's planned host buffers (offload's state, times the
    ranks an emulated rank stands for) must fit the host memory free here, else it would end as an ``oom`` record."""
    usable = usable_host_bytes() / GIB
    ranks = min(layout.world, layout.gpus_per_node)
    shared = train_overrides(base, layout) + layout.overrides()

    def unmeasurable(row: dict) -> str | None:
        need = (row["planned_peak_host_rss_gib"] - HOST_PROCESS / GIB) * ranks
        if need > usable:
            return f"its node's host buffers, {need:.0f} GiB, exceed the {usable:.0f} GiB free on this machine"
        try:
            config.validate(tune_config.compose(shared + row["point"].split(), config_name="train"))
        except ConfigError as e:
            return f"this machine refuses it: {e}"
        return None

    return unmeasurable


def device_at_hand(asked: str) -> tuple[str | None, int, str]:
    """(cuda | cpu | None, devices, the GPU's name or why nothing is measured)."""
    import torch

    if asked == "cpu":
        return "cpu", 1, "cpu"
    if torch.cuda.is_available():
        return "cuda", torch.cuda.device_count(), torch.cuda.get_device_name(0)
    if asked == "cuda":
        raise ConfigError("tune.device", "cuda asked, but this machine has no CUDA GPU (auto: plan only here)")
    return None, 0, "no GPU on this machine"


def layout_of(hw: Hardware, device: str, devices: int, gpu: str) -> Layout:
    """The measurement's layout, refused before any work where it cannot stand for the plan: a GPU other than the
    profile's, or an emulated rank of a profile the record cannot name (``parallel.emulate_hardware``)."""
    if device == "cuda" and hardware_option(gpu) != hw.name:
        raise ConfigError(
            "hardware",
            f"the plan is of {hw.name}, the GPU at hand is {gpu} (hardware={hardware_option(gpu)}): measure with its "
            "profile, or plan only (tune.measure=0)",
        )
    emulated = hw.gpus > devices or hw.nodes > 1
    if emulated and not (CONF_DIR / "hardware" / f"{hw.name}.yaml").is_file():
        raise ConfigError(
            "hardware",
            f"an emulated rank's planned wire reads conf/hardware/<name>.yaml; profile {hw.name!r} is not one",
        )
    return Layout(device, hw.nodes, hw.gpus_per_node, hw.name, emulated)


# Overrides of the tune's command line that do not reach train: the planner's hardware, the tune's own keys, and
# Hydra's settings but, for a sweep, the launcher's (where the measurement sweep's points run; a single run has none).
def train_overrides(base: list[str], layout: Layout | None = None, sweep: bool = True) -> list[str]:
    """``base`` as train takes it (as a sweep, else as one run), without the keys ``layout`` sets."""

    def key(override: str) -> str:
        return override.lstrip("+~").partition("=")[0]

    set_by_layout = {key(o) for o in layout.overrides()} if layout else set()
    kept = []
    for override in base:
        k = key(override)
        if k in set_by_layout or k == "hardware" or k.startswith(("hardware.", "tune.")):
            continue
        if k.startswith("hydra") and not (sweep and k.startswith(("hydra/launcher", "hydra.launcher"))):
            continue
        kept.append(override)
    return kept


def sweep_command(tune_dir: Path, base: list[str], layout: Layout, round_number: int = 1) -> list[str]:
    candidates, sweep_dir = round_files(round_number)
    return [
        sys.executable,
        "-m",
        "moe_lab.train",
        "-m",
        *train_overrides(base, layout),
        *layout.overrides(),
        "hydra/sweeper=candidates",
        f"hydra.sweeper.candidates={tune_dir.resolve() / candidates}",
        f"hydra.sweep.dir={tune_dir.resolve() / sweep_dir}",
    ]


def write_candidates(tune_dir: Path, points: list[str], round_number: int = 1) -> list[str]:
    """A round's candidates' overrides into its candidates file; a resumed tune keeps the ones its directory holds
    (the sweep's points are numbered by them), and refuses a directory holding candidates of another space."""
    path = tune_dir / round_files(round_number)[0]
    wanted = [p.split() for p in points]
    if path.exists():
        held = yaml.safe_load(path.read_text())
        if held != wanted:
            raise ConfigError(
                "tune.dir",
                f"{tune_dir} holds a tune with other candidates ({' | '.join(' '.join(c) for c in held)}); choose "
                "another tune.dir, or rerun that tune's own command to resume it",
            )
    else:
        path.write_text(yaml.safe_dump(wanted))
    return points


def status(tune_dir: Path, candidate: dict) -> str | None:
    return (read_result(tune_dir / run_dir_of(candidate)) or {}).get("status")


def measure(
    tune_dir: Path, base: list[str], layout: Layout, first: list[dict], replacement, on_round, progress: bool = True
) -> dict:
    """Measures ``first`` (ranked rows) as one sweep, then, round by round, a replacement for each that ran out of
    memory: ``replacement(gib)``, the best point left planned to hold less than any candidate that ran out (a point
    planned at as much would miss as they did), at most ``len(first)`` replacements in all. Shows candidates measured
    and the time left. ``on_round(candidates)`` is told the candidates so far (``candidate``, ``rank``, ``point``,
    ``run_dir``, ``replaces``) before each round runs. A round whose candidates all ended ok or out of memory (a
    resumed tune) is not run again. Returns how the sweeps ended (each with its candidates left without a record:
    a sweep where none ended ok exits 1, which its records already say)."""
    log_path = tune_dir / "measured.log"
    started = time.time()
    chosen: list[dict] = []
    sweeps: list[dict] = []
    rows, replaces = first, [None] * len(first)  # the first round replaces none
    ceiling = math.inf  # the least planned peak that ran out of memory: this machine does not hold what plans as much
    bar = ConsoleProgress("candidates measured", len(first), enabled=progress, unit="points")
    while rows:
        round_number = len(sweeps) + 1
        sweep_dir = round_files(round_number)[1]
        batch = [
            {"candidate": len(chosen) + i, "rank": row["rank"], "point": row["point"],
             "run_dir": f"{sweep_dir}/{i - 1}", "replaces": replaced}
            for i, (row, replaced) in enumerate(zip(rows, replaces), start=1)
        ]  # fmt: skip
        chosen += batch
        write_candidates(tune_dir, [c["point"] for c in batch], round_number)
        on_round(chosen)
        command = sweep_command(tune_dir, base, layout, round_number)
        sweep = {"round": round_number, "command": shlex.join(["python", *command[1:]]), "returncode": 0}
        if any(status(tune_dir, c) not in ("ok", "oom") for c in batch):
            sweep["returncode"], sweep["seconds"] = _run(command, tune_dir, batch, log_path, bar)
        else:
            sweep["seconds"], sweep["skipped"] = 0.0, "measured before"
            bar.advance(len(batch))
        ended = [status(tune_dir, c) for c in batch]  # read once after the round: the counts and replacements use it
        sweep["unrecorded"] = ended.count(None)
        sweeps.append(sweep)
        out_of_memory = [(c, row) for c, row, end in zip(batch, rows, ended) if end == "oom"]
        ceiling = min([ceiling, *(row["planned_peak_gpu_mem_gib"] for _, row in out_of_memory)])
        found = [(replacement(ceiling), c["candidate"]) for c, _ in out_of_memory[: 2 * len(first) - len(chosen)]]
        rows, replaces = [row for row, _ in found if row], [c for row, c in found if row]
        bar.grow(len(rows))
    bar.close()
    failed = next((s["returncode"] for s in sweeps if s["returncode"]), 0)
    return {
        "command": sweeps[0]["command"] if sweeps else None,
        "returncode": failed,
        "log": log_path.name,
        "layout": asdict(layout),
        "seconds": time.time() - started,
        "sweeps": sweeps,
    }


def _run(command: list[str], tune_dir: Path, batch: list[dict], log_path: Path, bar) -> tuple[int, float]:
    """One round's sweep, the bar moved as its candidates finish: (its exit code, its seconds)."""
    started = time.time()
    measured_before = bar.done

    def update() -> None:
        bar.advance(measured_before + sum(_finished(tune_dir, c, started) for c in batch) - bar.done)

    with open(log_path, "ab") as log:
        job = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while job.poll() is None:
            time.sleep(POLL_S)
            update()
    update()
    return job.returncode, time.time() - started


def _finished(tune_dir: Path, candidate: dict, started: float) -> bool:
    """The candidate's record written since ``started``, or an ok one from before (the sweep skips it)."""
    state = status(tune_dir, candidate)
    try:
        return state == "ok" or (
            state is not None and (tune_dir / run_dir_of(candidate) / RESULT).stat().st_mtime >= started
        )
    except OSError:
        return False
