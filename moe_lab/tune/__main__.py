"""``python -m moe_lab.tune``: the fastest setting that fits, planned over a search space, the best few measured.

Takes what ``python -m moe_lab.plan`` takes (the model and layout as for train, ``hardware`` and its mesh) plus the
``tune`` group (``conf/tune/``: the axes searched, ``tune.measure``, ``tune.device``, ``tune.dir``). Every point of
the space is planned, those that do not fit are dropped, the rest ranked by planned tokens/s/GPU; the best
``tune.measure`` are measured on the device at hand (one emulated rank where the layout is larger than the machine)
as one ``moe_lab.train`` sweep into ``<tune.dir>/measured``; without a GPU it stops after planning and says so. The
report (``report.md``, ``tune.png``) ends with the winner as a ``python -m moe_lab.train`` line:

    python -m moe_lab.tune +experiment=reference_30b trainer.steps=8 trainer.timing_skip=3 profile.enabled=false
    python -m moe_lab.tune +experiment=reference_235b hardware=b300 hardware.nodes=4 hardware.gpus_per_node=8 tune.measure=0
    python -m moe_lab.tune +experiment=reference_30b dispatcher=fused ac=full,selective  # one fixed, one narrowed
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
from hydra.errors import HydraException
from omegaconf import OmegaConf

from moe_lab.config import ConfigError
from moe_lab.config.validate import check_override_keys, check_target_node
from moe_lab.plan.hardware import GIB, profile_path_overrides
from moe_lab.plan.planner import build_hardware, plan, usable_device_bytes
from moe_lab.results.record import git_state
from moe_lab.results.tune import PLANS, TUNE, read_tune
from moe_lab.runtime.paths import CONF_DIR
from moe_lab.tune import config as tune_config
from moe_lab.tune import measure as measuring
from moe_lab.tune.config import TuneConfig
from moe_lab.tune.planning import (
    CandidateQueue,
    combinations,
    invalid_space,
    plan_all,
    point_config,
    point_name,
    rank,
    workers,
)
from moe_lab.tune.report import named_point, report
from moe_lab.tune.space import (
    Space,
    check_key_values,
    check_keys_exist,
    check_tune_overrides,
    group_combinations,
    narrowed,
)

PLAN_ONLY_SHOWN = 3
PLAN_COLUMNS = [
    "rank", "point", "status", "fits", "why", "same_plan_as", "planned_s_per_step", "planned_tokens_per_s_per_gpu",
    "planned_peak_gpu_mem_gib", "planned_mfu", "planned_compute_s", "planned_exposed_comm_s",
    "planned_outside_allocator_gib", "planned_device_total_gib", "planned_peak_host_rss_gib",
]  # fmt: skip


def compose_overrides(argv: list[str]) -> list[str]:
    """The command line without its sweeps (``ac=full,selective`` narrows an axis)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return [o.input_line for o in OverridesParser.create().parse_overrides(argv) if not o.is_sweep_override()]


def no_valid_point(why: str) -> ConfigError:
    """The refusal of a space no point of which is valid, ``why`` the first point's refusal."""
    key, _, message = why.partition(": ")
    return ConfigError(key, f"no point of the space is valid; the first: {message}")


def closest(ranked: list[dict], combos, hw) -> ConfigError:
    """The refusal of a space of which nothing fits: what is closest (the point of least device memory) and the
    largest sequence and depth at which it would fit, as the planner finds them."""
    ok = [r for r in ranked if r["status"] == "ok"]
    if not ok:  # valid points the planner then refused or failed on
        return no_valid_point(next((r for r in ranked if r["status"] == "invalid"), ranked[0])["why"])
    near = min(ok, key=lambda r: r["planned_device_total_gib"])
    cfg = next(point_config(c.cfg, keys) for c in combos for keys in c.keys if point_name(c, keys) == near["point"])
    largest = plan(cfg, hw, search=True)["plan"]["largest_fitting"]
    mode, fit = max(largest.items(), key=lambda item: (item[1]["seq_len"] or 0, item[1]["num_layers"] or 0))
    where = f"{len(ranked)} points planned on {hw.gpus} x {hw.name}"
    what = f"the closest, {named_point(near['point'], code=False)}, does not fit ({near['why']})"
    if fit["seq_len"]:
        return ConfigError(
            "data.seq_len",
            f"nothing fits ({where}); {what}; at data.seq_len <= {fit['seq_len']} it fits (offload={mode}; "
            f"model.num_layers <= {fit['num_layers']} at this length)",
        )
    if fit["num_layers"]:
        return ConfigError(
            "model.num_layers",
            f"nothing fits ({where}); {what}; at model.num_layers <= {fit['num_layers']} it fits (offload={mode})",
        )
    return ConfigError("hardware", f"nothing fits ({where}), at any length or depth; {what}")


def is_tune_key(override: str) -> bool:
    return override.lstrip("+~").partition("=")[0].partition(".")[0] == "tune"


def option_axes(own: list[str]) -> list[str]:
    """The axes of the tune option the command line chooses (``tune=<option>``), as its yaml lists them."""
    choice = [o for o in own if o.lstrip("+~").partition("=")[0] == "tune"]
    return list(tune_config.compose(choice).tune.axes)


def check_tune_dir(tune_dir: Path, n) -> None:
    """A directory holding another tune (its model, layout or space) is refused before any work: the same command
    resumes a tune, another one would overwrite its files."""
    if not (tune_dir / TUNE).is_file():
        return
    held = read_tune(tune_dir)
    if (held.get("base"), held.get("axes")) != (n.base, json.loads(json.dumps(n.axes))):
        raise ConfigError(
            "tune.dir",
            f"{tune_dir} holds another tune (`{held.get('command')}`); choose another tune.dir, or rerun that tune's "
            "own command to resume it",
        )


def passed_before(passed: list[dict], chosen: list[dict]) -> list[dict]:
    """The points passed over on the way to the lowest ranked of ``chosen`` (all of them where nothing was)."""
    last = max((row["rank"] for row in chosen), default=float("inf"))
    return sorted((row for row in passed if row["rank"] < last), key=lambda row: row["rank"])


def title(cfg, hw) -> str:
    m, d = cfg.model, cfg.data
    return (
        f"{m.get('name', 'model')} ({m.num_layers} layers, {m.num_experts} experts), seq {d.seq_len} x batch "
        f"{d.batch_size}, on {hw.gpus} x {hw.name}"
    )


def run(argv: list[str], progress: bool = True) -> tuple[Path, bool]:
    """The tune of ``argv`` (the command line's overrides); returns its directory and whether it named a winner."""
    if any(a in ("-m", "--multirun") for a in argv):
        raise ConfigError("-m", "a tune sweeps its own space; narrow an axis with key=a,b, no -m")
    # as train and plan check theirs; a key axis (ac.keep) needs only some point to have it
    check_override_keys([o for o in argv if not is_tune_key(o)], TuneConfig, every_option=False)
    own = [o for o in compose_overrides(argv) if is_tune_key(o)]
    check_tune_overrides([o for o in argv if is_tune_key(o)], option_axes(own))
    tune_node = tune_config.compose(own).tune
    check_target_node("tune", tune_node)
    settings = OmegaConf.to_container(tune_node, resolve=True)
    settings.pop("_target_")
    space = Space(**settings)
    n = narrowed(space, argv)
    cfg = tune_config.compose(n.base + own)  # the model and layout every point shares
    if cfg.parallel.emulate:
        raise ConfigError(
            "parallel.emulate", "the tune measures as an emulated rank where the layout needs it; leave it out"
        )
    hw = build_hardware(cfg.hardware, cfg.trainer.nproc_per_node)
    layout, measure_note = None, f"Plan only (tune.measure=0): the best {PLAN_ONLY_SHOWN} planned below."
    if space.measure:
        device, devices, gpu = measuring.device_at_hand(space.device)
        if device is None:
            measure_note = f"No GPU on this machine: stopped after planning; the same command on a GPU measures the best {space.measure}."
        else:
            layout = measuring.layout_of(hw, device, devices, gpu)
            measure_note = (
                f"The best {space.measure} measured as {layout.describe()}; one that runs out of memory is replaced "
                f"by the best point left planned to hold less than any that ran out (at most {space.measure})."
            )
    started = time.time()
    configs = [(groups, tune_config.compose(n.base + groups)) for groups in group_combinations(n.axes)]
    check_keys_exist(n.axes, [c for _, c in configs])
    check_key_values(n.axes, [c for _, c in configs])
    tune_dir = Path(space.dir)
    check_tune_dir(tune_dir, n)
    combos = combinations(configs, n.axes)
    # a setting no point takes (shared, or a value of an axis) refused before planning, with nothing written
    if (invalid := invalid_space(combos, workers(space.workers), progress)) is not None:
        raise no_valid_point(str(invalid))
    tune_dir.mkdir(parents=True, exist_ok=True)
    ranked = rank(plan_all(combos, workers(space.workers), progress))
    plan_seconds = time.time() - started
    plans = pd.DataFrame(ranked, columns=PLAN_COLUMNS)
    if not any(r["rank"] for r in ranked):
        plans.to_csv(tune_dir / PLANS, index=False)
        raise closest(ranked, combos, hw)
    # plan only: the best PLAN_ONLY_SHOWN planned stand in the table as what a measurement would take
    queue = CandidateQueue(ranked, measuring.unmeasurable_here(layout, n.base) if layout else lambda row: None)
    chosen = [row for row in (queue.take() for _ in range(space.measure or PLAN_ONLY_SHOWN)) if row]
    if layout is not None and chosen:  # a resumed tune's candidates are checked before its files are rewritten
        measuring.write_candidates(tune_dir, [row["point"] for row in chosen])
    plans.to_csv(tune_dir / PLANS, index=False)
    tune = {
        "title": title(cfg, hw),
        "started_utc": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "git": git_state(),
        "command": shlex.join(["python", "-m", "moe_lab.tune", *argv]),
        "base": n.base,
        "train_overrides": measuring.train_overrides(n.base, sweep=False),  # the winner's line: one run
        "axes": n.axes,
        "fixed": n.fixed,
        "hardware": {
            "name": hw.name,
            "nodes": hw.nodes,
            "gpus_per_node": hw.gpus_per_node,
            "usable_gib": usable_device_bytes(hw) / GIB,
            "describe": f"{hw.gpus} x {hw.name} ({hw.nodes} node(s) x {hw.gpus_per_node})",
        },
        "points": len(ranked),
        "plan_seconds": plan_seconds,
        "candidates": [{"candidate": i, "rank": r["rank"], "point": r["point"]} for i, r in enumerate(chosen, 1)],
        "passed_over": passed_before(queue.passed, chosen),
        "measure_note": measure_note,
        "measured": None,
    }
    (tune_dir / TUNE).write_text(json.dumps(tune, indent=1))
    if layout is not None and not chosen:
        tune["measure_note"] = (
            f"Nothing measured: no candidate this machine can measure ({len(queue.passed)} passed over)."
        )
    elif layout is not None:

        def on_round(measuring_now: list[dict]) -> None:  # a tune cut short keeps a report of what it measured
            tune["candidates"], tune["passed_over"] = measuring_now, passed_before(queue.passed, measuring_now)
            (tune_dir / TUNE).write_text(json.dumps(tune, indent=1))
            report(tune_dir)

        tune["measured"] = measuring.measure(tune_dir, n.base, layout, chosen, queue.take, on_round, progress)
        for sweep in tune["measured"]["sweeps"]:
            if sweep["returncode"] and sweep["unrecorded"]:
                tune["measure_note"] += (
                    f" Round {sweep['round']}'s sweep exited {sweep['returncode']} leaving {sweep['unrecorded']} of "
                    f"its candidates without a record: see {tune['measured']['log']}."
                )
        (tune_dir / TUNE).write_text(json.dumps(tune, indent=1))
    text, best = report(tune_dir)
    print(text)
    print(f"tune directory: {tune_dir}")
    return tune_dir, best is not None


def help_text() -> str:
    """The docstring, then the tune group's default option as it stands (its axes and keys, commented)."""
    default = CONF_DIR / "tune" / f"{tune_config.DEFAULT_TUNE}.yaml"
    return "\n".join(
        [
            __doc__.strip(),
            "",
            f"== The tune group (conf/tune/{default.name}; tune.<key>=value, +tune.axes.<name>=[...] adds an axis) ==",
            default.read_text().strip(),
            "",
            "The groups, presets and keys it takes beside: python -m moe_lab.plan --help. The rest: docs/tune.md.",
        ]
    )


def main() -> None:
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print(help_text())
        return
    try:
        _, named_winner = run(profile_path_overrides(sys.argv[1:]))
    except ConfigError as e:
        sys.exit(f"invalid tune: {e}")
    except HydraException as e:
        sys.exit(f"invalid tune: {e}")
    if not named_winner:  # as a sweep with no ok point: a script sees nothing measured ran
        sys.exit(1)


if __name__ == "__main__":
    main()
